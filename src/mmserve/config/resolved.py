"""ResolvedConfig: what the engine runs with after defaults and floors, as plain values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ResolvedConfig:
    """What the engine actually runs with, after defaults and floors; logged at start-up."""

    model: str
    architecture: str
    device: str
    dtype: str
    max_model_len: int
    num_kv_blocks: int
    kv_cache_bytes: int
    block_size: int
    enable_prefix_caching: bool
    max_num_batched_tokens: int
    max_num_seqs: int
    max_tokens_per_mm_item: int
    max_patches_per_mm_item: int
    encoder_cache_slots: int
    encoder_cache_bytes: int
    encoder_patch_budget: int
    chunked_mm_input: bool
    attention_backend: str
    layer_ops: str  # who computes the decoder's norms, SwiGLU and rotary: torch or triton
    encoder_cuda_graph: bool = False
    cuda_graph_sizes: tuple[int, ...] = ()  # decode batch sizes captured; () when eager

    def __post_init__(self) -> None:
        # a tuple whatever sequence a caller gives: the config is frozen all the way down
        object.__setattr__(self, "cuda_graph_sizes", tuple(self.cuda_graph_sizes))

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
