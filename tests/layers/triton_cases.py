"""Shared builders for the Triton attention tests: a paged batch and both backends' answers."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from mmserve.layers.attention import (
    AttentionBackend,
    TorchAttentionBackend,
    write_kv_cache,
)

# (cached tokens, new tokens) per sequence: odd lengths, decodes at and across block edges,
# fresh prefills, prefill chunks that start mid-block, and chunks longer than one query tile.
MIXED_BATCH = [(0, 1), (0, 15), (16, 1), (14, 17), (5, 33), (32, 1), (0, 17), (47, 2), (1, 1)]


@dataclass(frozen=True)
class PagedBatch:
    """One step's inputs over a KV cache that already holds every sequence's context."""

    shapes: list[tuple[int, int]]
    tables: list[list[int]]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    block_size: int

    @property
    def query_lens(self) -> list[int]:
        return [new for _, new in self.shapes]

    @property
    def seq_lens(self) -> list[int]:
        return [cached + new for cached, new in self.shapes]


def make_batch(
    shapes: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = "cpu",
) -> PagedBatch:
    """Shuffled, non-contiguous block ids (block 0 unused: it is the tables' padding)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shapes = list(shapes)
    rng.shuffle(shapes)
    need = [-(-(c + n) // block_size) for c, n in shapes]
    num_blocks = 2 * sum(need) + 3
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(k)] for k in need]
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    for (cached, _), table in zip(shapes, tables, strict=True):
        if cached:  # an earlier step wrote the context
            layout = TorchAttentionBackend().build_metadata([cached], [cached], [table], block_size)
            k, v = torch.randn(2, cached, num_kv_heads, head_dim, generator=gen).to(dtype)
            write_kv_cache(kv_cache, k, v, layout.slot_mapping)
    num_tokens = sum(n for _, n in shapes)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return PagedBatch(
        shapes,
        tables,
        kv_cache.to(device),
        rand(num_tokens, num_heads, head_dim),
        rand(num_tokens, num_kv_heads, head_dim),
        rand(num_tokens, num_kv_heads, head_dim),
        block_size,
    )


def run_backend(backend: AttentionBackend, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention output, the KV cache after the step) of one backend on a copy of the cache."""
    kv_cache = batch.kv_cache.clone()
    meta = backend.build_metadata(
        batch.query_lens, batch.seq_lens, batch.tables, batch.block_size, kv_cache.device
    )
    scale = batch.query.shape[-1] ** -0.5
    out = backend.forward(batch.query, batch.key, batch.value, kv_cache, meta, scale)
    return out, kv_cache


def reference(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    return run_backend(TorchAttentionBackend(), batch)
