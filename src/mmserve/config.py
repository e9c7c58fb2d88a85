"""Frozen engine configuration: scheduling, KV cache, multimodal. Validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.hashing import HASH_ALGORITHMS


@dataclass(frozen=True)
class SchedulerConfig:
    """Token and encoder budgets of one engine step, and the encoder cache's size.

    The encoder is budgeted in what costs memory:

    - per step, in **input patches** (`grid_t * grid_h * grid_w` of each item encoded): the
      vision tower's activations scale with them, not with the embeddings it returns.
      `encoder_patch_budget` defaults to `max_num_batched_tokens * patches_per_embed` (the
      patches behind as many embeddings as the step has tokens);
    - the cache, in **bytes**: an entry holds `num_embeds * encoder_embed_bytes` (hidden size
      x dtype size, exactly what the runner's tensor holds). `encoder_cache_bytes` sizes it,
      else `encoder_cache_size` embedding slots (default `max_num_batched_tokens`) do.

    Both are floored at the largest item the server accepts (`max_patches_per_mm_item`,
    `max_tokens_per_mm_item`, every modality), so a worst-case item always fits alone.
    `encoder_embed_bytes` 1 (the default) counts the cache in embeddings.
    """

    max_model_len: int
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_tokens_per_mm_item: int = 0
    max_patches_per_mm_item: int = 0
    disable_chunked_mm_input: bool = False
    encoder_cache_size: int | None = None
    encoder_cache_bytes: int | None = None
    encoder_patch_budget: int | None = None
    encoder_embed_bytes: int = 1
    patches_per_embed: int = 4  # spatial_merge_size ** 2 of Qwen2-VL

    def __post_init__(self) -> None:
        for name in (
            "max_model_len",
            "max_num_batched_tokens",
            "max_num_seqs",
            "encoder_embed_bytes",
            "patches_per_embed",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("encoder_cache_size", "encoder_cache_bytes", "encoder_patch_budget"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive when set, got {value}")
        if self.encoder_cache_size is not None and self.encoder_cache_bytes is not None:
            raise ValueError(
                "--encoder-cache-size (embedding slots) and --encoder-cache-bytes both size the "
                "encoder cache; give only one of them"
            )
        for name in ("max_tokens_per_mm_item", "max_patches_per_mm_item"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
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
    def effective_encoder_cache_bytes(self) -> int:
        """The encoder cache's capacity in bytes, floored at the largest item."""
        size = self.encoder_cache_bytes
        if size is None:
            num_slots = self.encoder_cache_size or self.max_num_batched_tokens
            size = num_slots * self.encoder_embed_bytes
        return max(size, self.max_tokens_per_mm_item * self.encoder_embed_bytes)

    @property
    def effective_encoder_cache_size(self) -> int:
        """The cache's capacity in embedding slots (whole embeddings that fit in its bytes)."""
        return self.effective_encoder_cache_bytes // self.encoder_embed_bytes

    @property
    def effective_encoder_patch_budget(self) -> int:
        """Input patches the vision encoder may process in one step, floored at the largest item."""
        budget = self.encoder_patch_budget or self.max_num_batched_tokens * self.patches_per_embed
        return max(budget, self.max_patches_per_mm_item)


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
