"""Frozen engine configuration: scheduling, KV cache, multimodal. Validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.hashing import HASH_ALGORITHMS


@dataclass(frozen=True)
class SchedulerConfig:
    """Token and encoder budgets of one engine step.

    `encoder_cache_size` (slots) and `encoder_compute_budget` (embeddings per step) default to
    `max_num_batched_tokens`; both are floored at `max_tokens_per_mm_item` so that one worst-case
    item always fits (vLLM V1 semantics).
    """

    max_model_len: int
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_tokens_per_mm_item: int = 0
    disable_chunked_mm_input: bool = False
    encoder_cache_size: int | None = None
    encoder_compute_budget: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("encoder_cache_size", "encoder_compute_budget"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive when set, got {value}")
        if self.max_tokens_per_mm_item < 0:
            raise ValueError("max_tokens_per_mm_item must be >= 0")
        if (
            self.disable_chunked_mm_input
            and self.max_tokens_per_mm_item > self.max_num_batched_tokens
        ):
            raise ValueError(
                f"--disable-chunked-mm-input needs max_num_batched_tokens >= the largest "
                f"multimodal item ({self.max_tokens_per_mm_item} tokens), got "
                f"max_num_batched_tokens={self.max_num_batched_tokens}: an item that can never "
                f"be scheduled whole would wait forever. Raise --max-num-batched-tokens to at "
                f"least {self.max_tokens_per_mm_item}, lower max_pixels, or allow chunking."
            )

    @property
    def effective_encoder_cache_size(self) -> int:
        size = self.encoder_cache_size or self.max_num_batched_tokens
        return max(size, self.max_tokens_per_mm_item)

    @property
    def effective_encoder_compute_budget(self) -> int:
        budget = self.encoder_compute_budget or self.max_num_batched_tokens
        return max(budget, self.max_tokens_per_mm_item)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block geometry, pool size and prefix caching."""

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    hash_algorithm: str = "blake3"

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise ValueError(
                f"hash_algorithm must be one of {HASH_ALGORITHMS}, got {self.hash_algorithm!r}"
            )
