"""torch.compile of the model's dense parts (`-O1`..`-O3`): every vision block and decoder layer.

What is compiled, and what stays outside:

    vision tower   patch embed | block 0 | block 1 | ... | merger        (blocks compiled)
    decoder        embed       | layer 0 | layer 1 | ... | norm, head    (layers compiled)
    one layer      [norm, q/k/v, rotary] -> attention -> [o_proj, norm, MLP]
                    compiled piece          eager        compiled piece

Attention is opaque to the compiler: the paged backends' `forward` and the vision tower's
`vision_attention` carry `torch.compiler.disable`, so dynamo breaks each layer's graph there and
inductor compiles the dense pieces on either side (piecewise, as vLLM does it). The attention
metadata (built on the host per step) and the paged KV cache never enter a compiled graph.
The layers keep torch's norms, SwiGLU and rotary (`TorchLayerOps`, the worker picks them when
compiling): inductor fuses those itself, where the hand-written Triton ops would be opaque
kernels to it.

Layers are compiled one by one, not the model as a whole: all layers of a stack run the same
code, and dynamo (inlining nn.Modules, their weights as graph inputs) compiles it once for the
stack, so compile time does not grow with depth. Shapes are dynamic (`dynamic=True`): one graph
serves every number of tokens; only a one-token call (a decode step of one sequence) gets a
graph of its own, as dynamo specialises sizes 0 and 1. `warm_up` compiles both at start-up
(logged with its time), so no request pays for a compile.

Inductor's artefacts (FX graph cache, AOT autograd cache, generated C++/Triton) go to
`cache_dir` (`--compile-cache-dir`), kept across restarts: a second start with the same model
shapes and torch reuses them (docs/compile.md has the measured start-up times).

CUDA graphs compose with it: the decode graphs and the encoder graphs capture whatever the
layers run, compiled kernels included (compiled code does no host work once warm).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from mmserve.execution.lm_threads import LMThreads, intra_op_threads
from mmserve.layers.attention import AttentionBackend

logger = logging.getLogger(__name__)

# A tiny image for the warm-up: 4 x 4 patches (one 2 x 2 group of merged tokens per side),
# enough for any tower's windows and merge.
_WARM_UP_GRID = (1, 4, 4)


class CompileReport(NamedTuple):
    """What start-up compiled: the time it took and the graphs dynamo made."""

    seconds: float
    num_graphs: int
    cache_dir: Path


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compiled_modules(model: nn.Module) -> Iterator[nn.Module]:
    """The modules compiled one by one: the vision tower's blocks and the decoder's layers."""
    yield from model.visual.blocks
    yield from model.model.layers


def compile_model(model: nn.Module, cache_dir: Path, backend: str = "inductor") -> None:
    """Compile `model`'s blocks and layers in place (lazily: `warm_up` runs the compiles).
    `backend` is torch.compile's: the engine always uses inductor; the GPU suite's CPU smoke
    run passes "aot_eager" (the same tracing and guards, no C++ to build).

    Inductor reads its cache location from the environment when it first needs it, so this
    process's TORCHINDUCTOR_CACHE_DIR is set to `cache_dir` here, before anything compiles;
    duck shaping is turned off for the process (torch's config: only compiles read it).
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    # NOTE: without this, a size that happens to equal another tensor's (2 tokens, 2 KV heads,
    # the KV cache's 2 planes) is guarded equal to it, and the next step recompiles.
    torch.fx.experimental._config.use_duck_shape = False
    for module in compiled_modules(model):
        module.compile(backend=backend, dynamic=True)


def warm_up(
    model: nn.Module,
    kv_caches: list[torch.Tensor],
    backend: AttentionBackend,
    *,
    block_size: int,
    device: torch.device,
    cache_dir: Path,
    lm_threads: LMThreads | None = None,
    max_num_tokens: int = 2,
) -> CompileReport:
    """Run the tower on a tiny image and the decoder on 2 tokens and on 1: every graph a
    request can need is compiled (or read from the cache) now. The decoder's steps write two
    slots of block 0 of the KV cache, which no request has yet: a request's tokens are written
    before they are read.

    Dynamo guards a graph on torch's intra-op thread count, and on a CPU a small step's
    language model runs on one thread (`lm_threads`, the runner's policy): the multi-token
    graph is compiled under each count a step of 2 to `max_num_tokens` tokens may run on, the
    one-token graph under a one-token step's (without a policy: the caller's count for all)."""
    graphs_before = compiled_graph_count()
    start = time.perf_counter()
    vision = model.config.vision
    patch_dim = vision.patch_input_dim
    grid = _WARM_UP_GRID
    dtype = next(model.parameters()).dtype
    with torch.inference_mode():
        pixels = torch.zeros(grid[0] * grid[1] * grid[2], patch_dim, device=device, dtype=dtype)
        model.embed_multimodal(pixels, [grid])
        model.embed_multimodal(torch.cat([pixels, pixels]), [grid, grid])  # two segments
        threads_for = lm_threads.threads_for if lm_threads else lambda _: torch.get_num_threads()
        multi_token = sorted({threads_for(2), threads_for(max(2, max_num_tokens))})
        for num_tokens, threads in [*((2, t) for t in multi_token), (1, threads_for(1))]:
            with intra_op_threads(threads):
                _decoder_step(model, kv_caches, backend, num_tokens, block_size, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report = CompileReport(
        time.perf_counter() - start, compiled_graph_count() - graphs_before, cache_dir
    )
    logger.info(
        "torch.compile (-O): vision blocks and decoder layers compiled in %.1f s (%d graphs; "
        "inductor cache %s, reused on the next start; -O0 or no -O: eager)",
        report.seconds,
        report.num_graphs,
        report.cache_dir,
    )
    return report


def _decoder_step(
    model: nn.Module,
    kv_caches: list[torch.Tensor],
    backend: AttentionBackend,
    num_tokens: int,
    block_size: int,
    device: torch.device,
) -> None:
    """One prefill of `num_tokens` tokens of one sequence in block 0 (num_tokens <= block_size)."""
    assert num_tokens <= block_size
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device).expand(3, num_tokens)  # [3, n]
    metadata = backend.build_metadata([num_tokens], [num_tokens], [[0]], block_size, device)
    embeds = model.embed_input_ids(input_ids)  # [n, hidden]
    model(None, positions.contiguous(), metadata, kv_caches, inputs_embeds=embeds)
