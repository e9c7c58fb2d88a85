"""Paged causal attention for the language model: the backend seam and its backends.

`metadata.py` (the batch's layout, built once per step), `backend.py` (the protocol),
`torch_backend.py` (SDPA: the CPU path and the oracle), `triton_backend.py` (Triton kernels for
CUDA, or the Triton interpreter on the CPU), `selector.py` (`--attention-backend`),
`kv_cache.py` (the reference store). The cache's shape and allocation are the model's
(`mmserve.models.kv_cache`).
"""

from mmserve.layers.attention.backend import AttentionBackend
from mmserve.layers.attention.kv_cache import write_kv_cache
from mmserve.layers.attention.metadata import AttentionForward, AttentionMetadata
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
    "AttentionForward",
    "AttentionMetadata",
    "DecodeBatch",
    "TorchAttentionBackend",
    "TorchPlan",
    "_decode_groups",
    "paged_attention",
    "select_backend",
    "write_kv_cache",
]
