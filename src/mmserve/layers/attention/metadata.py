"""AttentionMetadata: the flat batch's layout in the paged KV cache, built once per step.

KV cache layout, one tensor per decoder layer:

    kv_cache[layer]: [2, num_blocks, block_size, num_kv_heads, head_dim]
                      ^ 0 = keys, 1 = values

A token's K/V lives at one *slot*: `slot = block_id * block_size + offset_in_block`. A sequence
owns the blocks listed in its row of `block_tables`, in order, so its token at position p is
at slot `block_tables[i][p // block_size] * block_size + p % block_size`.

The batch is flat: the new tokens of sequence 0, then those of sequence 1, ... Sequence i's new
tokens are `query[query_start_loc[i]:query_start_loc[i+1]]` and they are its *last*
`q_len_i` tokens, so they sit at positions `seq_lens[i] - q_len_i ... seq_lens[i] - 1`:

    sequence i:  | cached context (seq_len - q_len) | new tokens (q_len) |
    new token j attends to keys at positions 0 ... (seq_len - q_len + j)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from mmserve.layers.attention.buffers import AttentionBuffers, BatchLimits


class AttentionForward(Protocol):
    """What a decoder layer calls on the backend its metadata names (`backend.py` has the
    whole seam and the contract of `forward`)."""

    name: str

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each new token's K/V goes, which cached tokens each sequence reads, and the
    backend that attends (with its own precomputed `plan`). Tensors live on the model's
    device; `query_start_loc_cpu` / `seq_lens_cpu` are host copies, so nothing syncs."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32: block ids per sequence
    seq_lens: torch.Tensor  # [num_seqs] int32: tokens of each sequence after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative new-token counts
    query_start_loc_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    block_size: int
    backend: AttentionForward
    plan: Any  # the backend's own per-step data (decode groups, query tiles), or None
    # rows past the real batch (a CUDA graph's padding): slot -1, never stored
    has_padding: bool = False

    def __post_init__(self) -> None:
        num_seqs = len(self.seq_lens_cpu)
        assert len(self.query_start_loc_cpu) == num_seqs + 1, "query_start_loc needs num_seqs + 1"
        assert self.block_tables.shape[0] == num_seqs, "one block table row per sequence"

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def query_lens(self) -> list[int]:
        loc = self.query_start_loc_cpu
        return [loc[i + 1] - loc[i] for i in range(self.num_seqs)]

    def with_plan(self, plan: Any) -> AttentionMetadata:
        return dataclasses.replace(self, plan=plan)


def build_layout(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str,
    backend: AttentionForward,
    buffers: AttentionBuffers | None = None,
) -> AttentionMetadata:
    """The backend-independent part, from python lists: per sequence, its new-token count, its
    total length after this step, and its block ids (which must cover `seq_len` tokens).
    `plan` is None; the backend's `build_metadata` adds its own.

    With `buffers` the tensors are views of those persistent buffers (filled on the host, sent
    without waiting for the device); without, new tensors. Values are the same either way:
    block table rows are padded with block 0 up to the batch's longest row.
    """
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError("query_lens, seq_lens and block_tables need one entry per sequence")
    for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if not 0 < q_len <= seq_len:
            raise ValueError(f"need 0 < query_len <= seq_len, got {q_len} and {seq_len}")
        if len(table) * block_size < seq_len:
            raise ValueError(
                f"block table of {len(table)} blocks holds {len(table) * block_size} tokens, "
                f"fewer than seq_len={seq_len}"
            )
    num_seqs = len(seq_lens)
    max_blocks = max((len(t) for t in block_tables), default=0)
    q = np.asarray(query_lens, dtype=np.int64).reshape(num_seqs)
    num_tokens = int(q.sum())
    if buffers is None:
        buffers = _exact_buffers(num_tokens, num_seqs, max_blocks)
    tables = buffers.block_tables.host_view(num_seqs, max_blocks)  # [num_seqs, max_blocks]
    tables.fill(0)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    starts = buffers.query_start_loc.host_view(num_seqs + 1)
    starts[0] = 0
    np.cumsum(q, out=starts[1:])
    buffers.seq_lens.host_view(num_seqs)[:] = seq_lens
    # token t of sequence i sits at position (seq_len_i - q_len_i) + (t - start_i)
    token_seq = np.repeat(np.arange(num_seqs), q)  # [num_tokens]
    context = np.asarray(seq_lens, dtype=np.int64).reshape(num_seqs) - q
    positions = np.arange(num_tokens) - starts[token_seq] + context[token_seq]
    slots = buffers.slot_mapping.host_view(num_tokens)
    slots[:] = tables[token_seq, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    metadata = AttentionMetadata(
        slot_mapping=buffers.slot_mapping.push(num_tokens),
        block_tables=buffers.block_tables.push(num_seqs, max_blocks),
        seq_lens=buffers.seq_lens.push(num_seqs),
        query_start_loc=buffers.query_start_loc.push(num_seqs + 1),
        query_start_loc_cpu=tuple(starts.tolist()),
        seq_lens_cpu=tuple(int(s) for s in seq_lens),
        block_size=block_size,
        backend=backend,
        plan=None,
    )
    return metadata if _is_on(metadata, device) else _moved(metadata, device)


def plan_buffers(metadata: AttentionMetadata, buffers: AttentionBuffers | None) -> AttentionBuffers:
    """Where a backend writes its plan: `buffers`, or new ones just large enough."""
    if buffers is not None:
        return buffers
    return _exact_buffers(metadata.num_tokens, metadata.num_seqs, 1)


def _exact_buffers(num_tokens: int, num_seqs: int, max_blocks: int) -> AttentionBuffers:
    """Host-only buffers of one batch's size (the caller moves the views to its device)."""
    limits = BatchLimits(max(1, num_tokens), max(1, num_seqs), max(1, max_blocks))
    return AttentionBuffers(limits, "cpu")


def _is_on(metadata: AttentionMetadata, device: torch.device | str) -> bool:
    want = torch.device(device)
    got = metadata.slot_mapping.device
    return got.type == want.type and (want.index is None or got.index == want.index)


def _moved(metadata: AttentionMetadata, device: torch.device | str) -> AttentionMetadata:
    """Buffers made for a CPU layout, sent to `device` (metadata built without buffers)."""
    return dataclasses.replace(
        metadata,
        slot_mapping=metadata.slot_mapping.to(device),
        block_tables=metadata.block_tables.to(device),
        seq_lens=metadata.seq_lens.to(device),
        query_start_loc=metadata.query_start_loc.to(device),
    )
