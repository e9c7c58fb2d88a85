"""Paged causal attention for the language model: the backend seam and its backends.

`metadata.py` (the batch's layout, built once per step), `backend.py` (the protocol),
`torch_backend.py` (SDPA: the CPU path and the oracle), `triton_backend.py` (Triton kernels for
CUDA, or the Triton interpreter on the CPU), `selector.py` (`--attention-backend`),
`kv_cache.py` (shape, size, allocation, the reference store).
"""

from mmserve.layers.attention.backend import AttentionBackend
from mmserve.layers.attention.kv_cache import (
    allocate_kv_caches,
    kv_cache_bytes_per_block,
    kv_cache_shape,
    write_kv_cache,
)
from mmserve.layers.attention.metadata import AttentionMetadata, build_attention_metadata
from mmserve.layers.attention.selector import select_backend
from mmserve.layers.attention.torch_backend import (
    MAX_SCORE_ELEMENTS,
    DecodeBatch,
    TorchAttentionBackend,
    TorchPlan,
    _decode_groups,
    paged_attention,
)

__all__ = [
    "MAX_SCORE_ELEMENTS",
    "AttentionBackend",
    "AttentionMetadata",
    "DecodeBatch",
    "TorchAttentionBackend",
    "TorchPlan",
    "_decode_groups",
    "allocate_kv_caches",
    "build_attention_metadata",
    "kv_cache_bytes_per_block",
    "kv_cache_shape",
    "paged_attention",
    "select_backend",
    "write_kv_cache",
]
