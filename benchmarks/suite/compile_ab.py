"""torch.compile against eager (-O3 vs none): the vision tower and a decode step, paired A/B.

The engine's own compile (`mmserve.execution.compile.compile_model`: blocks and layers, attention
left outside) is applied to one model; a copy with the same weights runs eagerly. Calls
alternate eager, compiled, eager, compiled... in one process, and each pair gives a ratio, so a
loaded machine slows both sides of a pair alike: the median ratio is the figure, the medians of
the times only a guide. Random weights, a few layers of the given shape: the per-layer cost is
what compile changes, and every layer is the same.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from benchmarks.suite.profile import QWEN2_VL_2B_LAYERS, Profile
from benchmarks.suite.timing import synchronize
from tests.support.factory import tiny_config_dict

from mmserve.execution.compile import compile_model, compiled_graph_count, warm_up
from mmserve.layers.attention import select_backend
from mmserve.models.config import parse_model_config
from mmserve.models.kv_cache import allocate_kv_caches
from mmserve.models.registry import get_model_class

BLOCK_SIZE = 16
MID_2B = QWEN2_VL_2B_LAYERS  # Qwen2-VL-2B's layer widths; the depth is the caller's


def _config(shape: dict[str, Any], layers: int):
    ids = {"<|endoftext|>": 0, "<|im_end|>": 1, "<|image_pad|>": 2, "<|video_pad|>": 3}
    ids |= {"<|vision_start|>": 4, "<|vision_end|>": 5}
    text = {**shape.get("text", {}), "num_hidden_layers": layers}
    vision = {**shape.get("vision", {}), "depth": layers}
    raw = tiny_config_dict("qwen2_vl", 1024, ids, text=text, vision=vision)
    return parse_model_config(raw)


def _paired(eager: Callable[[], object], compiled: Callable[[], object], pairs: int, device: str):
    ratios, eager_s, compiled_s = [], [], []
    for fn in (eager, compiled):  # first calls (allocator, caches) are not timed
        fn()
    for _ in range(pairs):
        times = []
        for fn in (eager, compiled):
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times.append(time.perf_counter() - start)
        eager_s.append(times[0])
        compiled_s.append(times[1])
        ratios.append(times[0] / times[1])
    return {
        "eager_ms_median": statistics.median(eager_s) * 1e3,
        "compiled_ms_median": statistics.median(compiled_s) * 1e3,
        "speedup_median": statistics.median(ratios),  # eager time / compiled time, per pair
        "speedup_min": min(ratios),
        "speedup_max": max(ratios),
        "pairs": pairs,
    }


def compare_compile(
    shape: dict[str, Any],
    *,
    layers: int,
    image: tuple[int, int],
    decode_batches: tuple[int, ...],
    pairs: int,
    device: str,
    dtype: str,
    cache_dir: Path | None = None,
    compile_backend: str = "inductor",
) -> dict[str, Any]:
    """ViT on one `image` (width, height) and decode steps at `decode_batches`, eager vs -O3."""
    torch_device, torch_dtype = torch.device(device), getattr(torch, dtype)
    config = _config(shape, layers)
    torch.manual_seed(0)
    with torch.device(torch_device):
        eager = get_model_class(config.architecture)(config).to(torch_dtype).eval()
    for p in eager.parameters():
        torch.nn.init.normal_(p, std=0.02)
    compiled = copy.deepcopy(eager)  # the same weights (a vocabulary of 1,024: small)
    backend = select_backend(
        "auto", torch_device, block_size=BLOCK_SIZE, head_dim=config.text.head_dim
    )
    max_batch = max(decode_batches)
    num_blocks = max_batch * 4 + 1
    kv = allocate_kv_caches(config, num_blocks, BLOCK_SIZE, torch_device, torch_dtype)
    with tempfile.TemporaryDirectory() as tmp:
        cache = cache_dir or Path(tmp)
        graphs_before = compiled_graph_count()
        compile_model(compiled, cache, compile_backend)
        report = warm_up(
            compiled, kv, backend, block_size=BLOCK_SIZE, device=torch_device, cache_dir=cache
        )
        out: dict[str, Any] = {
            "layers": layers,
            "backend": compile_backend,
            "compile_s": report.seconds,
            "graphs": report.num_graphs,
            "dtype": dtype,
        }
        merge = config.vision.patch_size * config.vision.spatial_merge_size
        grid = (1, image[1] // merge * 2, image[0] // merge * 2)
        pixels = torch.randn(grid[1] * grid[2], config.vision.patch_input_dim, device=torch_device)
        pixels = pixels.to(torch_dtype)
        with torch.inference_mode():
            want = eager.embed_multimodal(pixels, [grid])[0]
            got = compiled.embed_multimodal(pixels, [grid])[0]
            vit = _paired(
                lambda: eager.embed_multimodal(pixels, [grid]),
                lambda: compiled.embed_multimodal(pixels, [grid]),
                pairs,
                device,
            )
            vit |= {"image": f"{image[0]}x{image[1]}", "max_abs_diff": _diff(want, got)}
            out["vit"] = vit
            out["decode"] = []
            for batch in decode_batches:
                step = _decode_step(config, kv, backend, batch, torch_device)
                row = _paired(lambda s=step: s(eager), lambda s=step: s(compiled), pairs, device)
                row |= {"batch": batch, "max_abs_diff": _diff(step(eager), step(compiled))}
                out["decode"].append(row)
        out["recompiles_after_warm_up"] = compiled_graph_count() - graphs_before - report.num_graphs
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _decode_step(config, kv, backend, batch: int, device: torch.device):
    """One decode step of `batch` sequences of 3 blocks' context each (hidden states out)."""
    seq_len = 3 * BLOCK_SIZE
    tables = [[1 + 4 * i + j for j in range(4)] for i in range(batch)]
    input_ids = (torch.arange(batch, device=device) * 7 + 3) % config.text.vocab_size
    positions = torch.full((3, batch), seq_len - 1, device=device)

    def step(model):
        metadata = backend.build_metadata(
            [1] * batch, [seq_len] * batch, tables, BLOCK_SIZE, device
        )
        embeds = model.embed_input_ids(input_ids)
        return model(None, positions, metadata, kv, inputs_embeds=embeds)

    return step


def compile_section(profile: Profile) -> dict[str, Any]:
    """The GPU suite's rows (the profile's shape, device and dtype)."""
    return compare_compile(
        profile.compile_shape,
        layers=profile.compile_layers,
        image=profile.compile_image,
        decode_batches=profile.compile_batches,
        pairs=profile.compile_pairs,
        device=profile.device,
        dtype=profile.dtype,
        compile_backend=profile.compile_backend,
    )
