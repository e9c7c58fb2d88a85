"""ResolvedConfig: what the engine core actually runs with, sent once to the API process."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

_NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
_PosInt = Annotated[int, msgspec.Meta(ge=1)]


class ResolvedConfig(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """The engine's settings after defaults and floors (KV blocks, budgets, backends).

    The engine core logs it at start-up and sends it in `EngineCoreReady`; the API process
    logs it and sizes admission from it. Its bounds are checked on decode.
    """

    model: str
    architecture: str
    device: str
    dtype: str
    max_model_len: _PosInt
    num_kv_blocks: _PosInt
    kv_cache_bytes: _NonNegInt
    block_size: _PosInt
    enable_prefix_caching: bool
    max_num_batched_tokens: _PosInt
    max_num_seqs: _PosInt
    max_tokens_per_mm_item: _NonNegInt
    max_patches_per_mm_item: _NonNegInt
    encoder_cache_slots: _NonNegInt
    encoder_cache_bytes: _NonNegInt
    encoder_patch_budget: _NonNegInt
    chunked_mm_input: bool
    attention_backend: str
    layer_ops: str  # who computes the decoder's norms, SwiGLU and rotary: torch or triton
    encoder_cuda_graph: bool = False
    cuda_graph_sizes: tuple[_PosInt, ...] = ()  # decode batch sizes captured; () when eager
    compiled: bool = False  # -O1..-O3: vision blocks and decoder layers run torch.compile'd

    def __post_init__(self) -> None:
        # a tuple whatever sequence a caller gives: the config is frozen all the way down
        msgspec.structs.force_setattr(self, "cuda_graph_sizes", tuple(self.cuda_graph_sizes))

    def as_dict(self) -> dict[str, Any]:
        """By field name, in field order (what start-up logs and the benchmarks print)."""
        return msgspec.structs.asdict(self)
