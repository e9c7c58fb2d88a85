"""The Triton attention backend: the KV store and paged attention as one launch each.

CUDA is its home; on the CPU it runs under Triton's interpreter (TRITON_INTERPRET=1), which is
how the tests check it against the torch reference. Kernels: `triton_kernels.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmserve.layers.attention.buffers import AttentionBuffers
from mmserve.layers.attention.metadata import AttentionMetadata, build_layout, plan_buffers
from mmserve.layers.attention.triton_kernels import compile_kernels

# A captured graph's padding rows read block 0: any block serves, since they store nothing and
# their rows are dropped; reading a real sequence's block changes nothing for that sequence.
DUMMY_BLOCK = 0
# New tokens of one sequence per query tile. Rows per tile are this times the query heads per
# KV head (padded to a power of two); 16 keeps tl.dot's operands at least 16 wide.
QUERY_TOKENS_PER_TILE = 16
# The widest head the kernels take: flash attention's limit, and the widest lowered for sm_90
# in tests/layers/aot_compile.py. A tile's float32 accumulator is rows x the head dim padded to
# a power of two; wider heads (no served model has them) would spill it, untested, so they are
# refused. Any even head dim up to it runs, the pad's tail masked (24 in 32, 72 in 128).
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class TritonPlan:
    """The query tiles of one step: tile t covers new tokens q_start[t] ... of sequence
    seq_idx[t] (up to `tokens_per_tile` of them)."""

    tile_seq_idx: torch.Tensor  # [num_tiles] int32
    tile_q_start: torch.Tensor  # [num_tiles] int32
    num_tiles: int
    tokens_per_tile: int


def check_block_size(block_size: int) -> None:
    """Kernel tiles are powers of two and tl.dot's operands at least 16 wide."""
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(
            f"--block-size {block_size}: the triton attention backend needs a power of two "
            ">= 16 (16, 32, ...); change --block-size or use --attention-backend torch"
        )


def takes_head_dim(head_dim: int) -> bool:
    """Even (rotary rotates halves) and at most MAX_HEAD_DIM; not a power of two is fine."""
    return 2 <= head_dim <= MAX_HEAD_DIM and head_dim % 2 == 0


def check_head_dim(head_dim: int) -> None:
    if not takes_head_dim(head_dim):
        raise ValueError(
            f"head_dim {head_dim}: the triton attention backend takes even head dims up to "
            f"{MAX_HEAD_DIM} (multiples of 8 such as 24, 72, 80 and 128 included); "
            "use --attention-backend torch for this model"
        )


class CaptureBuffers:
    """The fixed metadata buffers captured decode graphs read, for up to `max_num_seqs` rows:

    row:          0 ........ n-1 | n ......... size-1
    slot          real slots     | -1 (the KV store skips it: nothing is written)
    seq_len       real lengths   | 1  (a dummy sequence: one key, the dummy block's slot 0)
    block table   real rows      | [DUMMY_BLOCK, ...]
    tile          one per row (tile i = sequence i, its only token): `size` tiles
    """

    def __init__(
        self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, device: torch.device
    ) -> None:
        n = max_num_seqs
        i32 = dict(dtype=torch.int32, device=device)
        self.block_size = block_size
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, **i32)
        self.block_tables = torch.full((n, max_blocks_per_seq), DUMMY_BLOCK, **i32)
        # constant for every decode step: sequence i is row i, its one token is token i
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.tile_seq_idx = torch.arange(n, **i32)
        self.tile_q_start = torch.zeros(n, **i32)

    def metadata(self, size: int, backend: TritonAttentionBackend) -> AttentionMetadata:
        plan = TritonPlan(
            tile_seq_idx=self.tile_seq_idx[:size],
            tile_q_start=self.tile_q_start[:size],
            num_tiles=size,
            tokens_per_tile=backend.tokens_per_tile,
        )
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            query_start_loc_cpu=tuple(range(size + 1)),
            seq_lens_cpu=(1,) * size,  # capture time's; the kernels read the device buffer
            block_size=self.block_size,
            backend=backend,
            plan=plan,
            has_padding=True,
        )

    def fill(self, meta: AttentionMetadata, size: int) -> bool:
        n, width = meta.num_seqs, meta.block_tables.shape[1]
        if n > size or meta.block_size != self.block_size or width > self.block_tables.shape[1]:
            return False
        # device-to-device copies from the step's buffers, then the padding rows' values
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:size].fill_(1)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[n:size, 0].fill_(DUMMY_BLOCK)
        return True


class TritonAttentionBackend:
    """Paged attention and the KV store in Triton (see `triton_kernels.py`)."""

    name = "triton"
    # one launch per layer whose grid is fixed by the padded size: a graph replays it as is
    supports_capture = True

    def __init__(self, tokens_per_tile: int = QUERY_TOKENS_PER_TILE) -> None:
        assert tokens_per_tile > 0 and tokens_per_tile & (tokens_per_tile - 1) == 0
        self.tokens_per_tile = tokens_per_tile
        self.kernels = compile_kernels()
        self._capture: CaptureBuffers | None = None

    def init_capture(
        self,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        check_block_size(block_size)
        self._capture = CaptureBuffers(max_num_seqs, max_blocks_per_seq, block_size, device)

    def prepare_for_capture(self, num_seqs: int) -> AttentionMetadata:
        """Views of the capture buffers, the padded plan: one tile per row, `num_seqs` tiles
        (a grid fixed at capture)."""
        assert self._capture is not None, "init_capture first"
        return self._capture.metadata(num_seqs, self)

    def prepare_for_replay(self, metadata: AttentionMetadata, num_seqs: int) -> bool:
        assert self._capture is not None, "init_capture first"
        return self._capture.fill(metadata, num_seqs)

    def build_metadata(
        self,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        *,
        buffers: AttentionBuffers | None = None,
    ) -> AttentionMetadata:
        check_block_size(block_size)
        layout = build_layout(query_lens, seq_lens, block_tables, block_size, device, self, buffers)
        tiles_per_seq = [-(-q_len // self.tokens_per_tile) for q_len in query_lens]
        num_tiles = sum(tiles_per_seq)
        buffers = plan_buffers(layout, buffers)
        seq_idx = buffers.tile_seq_idx.host_view(num_tiles)
        q_start = buffers.tile_q_start.host_view(num_tiles)
        tile = 0
        for i, count in enumerate(tiles_per_seq):
            seq_idx[tile : tile + count] = i
            q_start[tile : tile + count] = range(
                0, count * self.tokens_per_tile, self.tokens_per_tile
            )
            tile += count
        plan = TritonPlan(
            tile_seq_idx=buffers.tile_seq_idx.push(num_tiles).to(layout.slot_mapping.device),
            tile_q_start=buffers.tile_q_start.push(num_tiles).to(layout.slot_mapping.device),
            num_tiles=num_tiles,
            tokens_per_tile=self.tokens_per_tile,
        )
        return layout.with_plan(plan)

    # Opaque to torch.compile (`execution/compile.py`): per-step metadata and the paged cache
    # stay outside the compiled pieces between attentions.
    @torch.compiler.disable
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        plan = metadata.plan
        assert isinstance(plan, TritonPlan), "metadata built by another backend"
        store_kv(self, kv_cache, key, value, metadata.slot_mapping)
        num_tokens, num_heads, head_dim = query.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        assert block_size == metadata.block_size, "the cache's block size differs"
        query = query.to(kv_cache.dtype)
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        if plan.num_tiles == 0:
            return out
        assert query.stride(2) == 1 and kv_cache.is_contiguous()
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self.kernels.paged_attention[(plan.num_tiles, num_kv_heads)](
            out,
            query,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            plan.tile_seq_idx,
            plan.tile_q_start,
            scale,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            metadata.block_tables.stride(0),
            **paged_attention_specialisation(
                num_heads,
                num_kv_heads,
                head_dim,
                block_size,
                plan.tokens_per_tile,
                kv_cache.dtype,
                is_interpreted=self.kernels.is_interpreted,
            ),
        )
        return out


def paged_attention_specialisation(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    tokens_per_tile: int,
    dtype: torch.dtype,
    *,
    is_interpreted: bool,
) -> dict[str, Any]:
    """The constexprs and `num_warps` of one paged attention launch (what it is compiled
    for; tests/layers/aot_compile.py lowers the same ones for sm_90 without a GPU)."""
    group = num_heads // num_kv_heads
    group_pad = _next_power_of_two(group)
    head_pad = max(16, _next_power_of_two(head_dim))
    return {
        "GROUP": group,
        "GROUP_PAD": group_pad,
        "BLOCK_Q": tokens_per_tile,
        "BLOCK_SIZE": block_size,
        "HEAD_DIM": head_dim,
        "HEAD_PAD": head_pad,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "DOT_IN_FP32": is_interpreted and dtype == torch.bfloat16,
        # A tile's float32 accumulator is rows x head_pad: more warps keep it in registers.
        "num_warps": 8 if tokens_per_tile * group_pad * head_pad > 8192 else 4,
    }


def store_kv_specialisation(num_kv_heads: int, head_dim: int, block_size: int) -> dict[str, Any]:
    """The constexprs of one KV store launch (default `num_warps`)."""
    return {
        "BLOCK_SIZE": block_size,
        "HEAD_DIM": head_dim,
        "HEAD_PAD": _next_power_of_two(head_dim),
        "KV_HEADS_PAD": _next_power_of_two(num_kv_heads),
    }


def store_kv(
    backend: TritonAttentionBackend,
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`write_kv_cache` as one launch: key/value [num_tokens, num_kv_heads, head_dim] into
    `kv_cache` at `slot_mapping` (int64 [num_tokens]; a negative slot is skipped)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    # Rounded by torch (a no-op when the model's dtype is the cache's): the stored bits then
    # equal write_kv_cache's, and Triton's interpreter, which truncates float32 to bfloat16,
    # agrees too.
    key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.is_contiguous()
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    backend.kernels.store_kv[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        **store_kv_specialisation(num_kv_heads, head_dim, kv_cache.shape[2]),
    )


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()
