"""One mmserve LLM for a section, sized so that several can run one after another on one GPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.suite.profile import Profile
from benchmarks.suite.timing import release_memory

from mmserve import LLM
from mmserve.config.engine import EngineConfig, keyword_owners
from mmserve.config.resolved import ResolvedConfig

ENGINE_FIELDS = frozenset(keyword_owners())
RESOLVED_FIELDS = ResolvedConfig.__struct_fields__
# What an engine of a section ran with, from its resolved configuration (recorded beside its
# figures): the kernels, the graphs and the encoder budget they were measured under.
RECORDED_FIELDS = (
    "attention_backend",
    "layer_ops",
    "cuda_graph_sizes",
    "encoder_cuda_graph",
    "encoder_patch_budget",
    "max_num_seqs",
    "num_kv_blocks",
)


def resolved_fields(llm: LLM) -> dict[str, Any]:
    config = llm.config.as_dict()
    return {name: config.get(name) for name in RECORDED_FIELDS}


def engine_defaults(profile: Profile) -> dict[str, Any]:
    """What an engine on this profile's device picks without flags, before any is built: the
    attention backend, the layer ops, the decode graph sizes at the decode section's largest
    batch, the encoder graphs (off unless asked)."""
    import torch

    from mmserve.execution.graphs.decode import graph_sizes_for
    from mmserve.layers.attention import select_backend
    from mmserve.layers.fused import select_layer_ops

    device = torch.device(profile.device)
    config = EngineConfig.from_kwargs(max_num_seqs=max(profile.decode_batches))
    backend = select_backend(
        config.device.attention_backend, device, block_size=config.cache.block_size
    )
    sizes = graph_sizes_for(
        enforce_eager=config.device.enforce_eager,
        device=device,
        backend=backend,
        max_num_seqs=config.scheduler.max_num_seqs,
        requested=config.device.cuda_graph_sizes,
    )
    return {
        "attention_backend": backend.name,
        "layer_ops": select_layer_ops(backend.name).name,
        "cuda_graph_sizes": list(sizes),
        "encoder_cuda_graph": config.device.enable_encoder_cuda_graph,
        "resolved_config_fields": list(RESOLVED_FIELDS),
    }


@contextmanager
def open_llm(profile: Profile, model_dir: Path, dtype: str, **extra: Any) -> Iterator[LLM]:
    """A fixed KV pool (not 90% of the GPU) so that the next section's model fits beside what
    the allocator still caches; shut down and released on leaving."""
    llm = LLM(
        model=str(model_dir),
        device=profile.device,
        dtype=dtype,
        kv_cache_memory_bytes=profile.kv_cache_memory_bytes,
        **extra,
    )
    try:
        yield llm
    finally:
        llm.shutdown()
        del llm
        release_memory(profile.device)
