"""Scheduler and KV cache configuration: the token and encoder budgets of a step, the KV pool."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from mmserve.config.flags import check_choice, check_positive, flag, show_default
from mmserve.hashing import DEFAULT_HASH_ALGORITHM, HASH_ALGORITHMS

MODEL = "Model"
SCHEDULER = "Scheduler"
CACHE = "Cache"
# The KV pool on a CPU, where no profile run sizes it (--kv-cache-memory-bytes sets it).
CPU_KV_CACHE_BYTES = 2 << 30


@dataclass(frozen=True)
class SchedulerConfig:
    """Token and encoder budgets of one engine step, and the encoder cache's size.

    The encoder is budgeted in what costs memory:

    - per step, in **input patches** (`grid_t * grid_h * grid_w` of each item encoded): the
      vision tower's activations scale with them, not with the embeddings it returns.
      `encoder_patch_budget` defaults to `max_num_batched_tokens * patches_per_embed` (the
      patches behind as many embeddings as the step has tokens);
    - the cache, in **bytes**: an entry holds `num_embeds * encoder_embed_bytes` (one encoder
      output row: hidden size x (1 + DeepStack levels) x dtype size, exactly what the runner's
      tensor holds). `encoder_cache_bytes` sizes it, else `encoder_cache_size` embedding slots
      (default `max_num_batched_tokens`) do.

    Both are floored at the largest item the server accepts (`max_patches_per_mm_item`,
    `max_tokens_per_mm_item`, every modality), so a worst-case item always fits alone.
    `encoder_embed_bytes` 1 (the default) counts the cache in embeddings.

    The fields without a flag are what the factory derives from the checkpoint (`resolved`);
    `max_model_len` None (the flag's default) means the checkpoint's maximum, and a scheduler
    only ever gets a config where the factory has set it.
    """

    max_model_len: int | None = flag(
        None,
        type=int,
        group=MODEL,
        help="Longest prompt + output in tokens; default: the checkpoint's maximum.",
    )
    max_num_batched_tokens: int = flag(
        8192,
        type=int,
        group=SCHEDULER,
        help="Token budget of one engine step (prefill chunks + decodes); also the default "
        "encoder cache size (this many embeddings) and per-step encoder budget (the input "
        "patches behind this many embeddings). Default {default}.",
    )
    encoder_patch_budget: int | None = flag(
        None,
        type=int,
        group=SCHEDULER,
        metavar="PATCHES",
        help="Input patches (grid_t x grid_h x grid_w per image or video) the vision encoder may "
        "process in one engine step: what its activation memory scales with. Default "
        "--max-num-batched-tokens x spatial_merge_size^2, floored at the largest item.",
    )
    max_num_seqs: int = flag(
        256, type=int, group=SCHEDULER, help="Most requests running at once. Default {default}."
    )
    disable_chunked_mm_input: bool = flag(
        False,
        action="store_true",
        group=SCHEDULER,
        help="Never split one image's placeholder span across engine steps; rejected at start "
        "when the largest image needs more than --max-num-batched-tokens.",
    )
    encoder_cache_size: int | None = flag(
        None,
        type=int,
        group=CACHE,
        metavar="SLOTS",
        help="Encoder cache size in embedding slots (one encoder output row each: hidden size "
        "x (1 + DeepStack levels) x dtype bytes); default --max-num-batched-tokens, floored at "
        "the largest image or video.",
    )
    encoder_cache_bytes: int | None = flag(
        None,
        type=int,
        group=CACHE,
        metavar="BYTES",
        help="Encoder cache size in bytes, instead of --encoder-cache-size; floored at the "
        "largest image or video.",
    )
    # Derived from the checkpoint by the factory (no flag).
    max_tokens_per_mm_item: int = 0
    max_patches_per_mm_item: int = 0
    encoder_embed_bytes: int = 1
    patches_per_embed: int = 4  # spatial_merge_size ** 2 of Qwen2-VL

    def __post_init__(self) -> None:
        for name in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "encoder_embed_bytes",
            "patches_per_embed",
        ):
            check_positive(name, getattr(self, name))
        for name in (
            "max_model_len",
            "encoder_cache_size",
            "encoder_cache_bytes",
            "encoder_patch_budget",
        ):
            check_positive(name, getattr(self, name), optional=True)
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
    """Paged KV cache: block geometry, pool size and prefix caching.

    `num_blocks` is the pool the factory sized (no flag): from --num-gpu-blocks-override,
    --kv-cache-memory-bytes or the start-up profile; a scheduler only gets a config with it set.
    """

    block_size: int = flag(
        16, type=int, group=CACHE, help="Tokens per KV-cache block. Default {default}."
    )
    enable_prefix_caching: bool = flag(
        True,
        action=argparse.BooleanOptionalAction,
        group=CACHE,
        help="Reuse KV blocks of identical prefixes (images keyed by identity). Default on.",
    )
    num_gpu_blocks_override: int | None = flag(
        None,
        type=int,
        group=CACHE,
        metavar="N",
        help="KV pool size in blocks, instead of sizing it from free memory.",
    )
    kv_cache_memory_bytes: int | None = flag(
        None,
        type=int,
        group=CACHE,
        metavar="BYTES",
        aliases=("--kv-cache-memory",),
        help="KV pool size in bytes, instead of sizing it by the start-up profile run (a CPU "
        f"has none: {show_default(CPU_KV_CACHE_BYTES, 'bytes')} there unless given).",
    )
    hash_algorithm: str = flag(
        DEFAULT_HASH_ALGORITHM,
        choices=HASH_ALGORITHMS,
        group=CACHE,
        help="Digest for item identity and prefix-cache keys (sha256 for FIPS).",
    )
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        check_positive("block_size", self.block_size)
        for name in ("num_blocks", "num_gpu_blocks_override", "kv_cache_memory_bytes"):
            check_positive(name, getattr(self, name), optional=True)
        if self.num_gpu_blocks_override is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError(
                "--num-gpu-blocks-override and --kv-cache-memory-bytes both size the KV pool; "
                "give only one of them"
            )
        check_choice("hash_algorithm", self.hash_algorithm, HASH_ALGORITHMS)
