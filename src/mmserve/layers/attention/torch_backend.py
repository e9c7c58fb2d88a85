"""The reference attention backend: torch SDPA, any device, any float dtype; the CPU path.

Correct for any block layout (see `metadata.py` for the layout). Decodes are batched into one
SDPA call per group of sequences of similar length (little padding); prefill chunks run one
sequence at a time with their queries cut into chunks to bound the score matrix. The decode
groups are planned once per step in `build_metadata`, never inside the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmserve.layers.attention.buffers import AttentionBuffers
from mmserve.layers.attention.kv_cache import write_kv_cache
from mmserve.layers.attention.metadata import AttentionMetadata, build_layout, plan_buffers

# Upper bound on attention-score elements (heads x queries x keys) per SDPA call of the prefill
# path, so that a fallback math kernel never materialises a huge matrix (1 GiB in float32).
MAX_SCORE_ELEMENTS = 1 << 28


@dataclass(frozen=True)
class DecodeBatch:
    """Decode sequences attended in one SDPA call, their keys padded to `max_blocks` blocks."""

    seq_idx: torch.Tensor  # [n] int64: rows of the metadata's per-sequence tensors
    token_idx: torch.Tensor  # [n] int64: the sequences' new tokens in the flat batch
    max_blocks: int


@dataclass(frozen=True)
class TorchPlan:
    """The torch backend's per-step plan: decode groups, then the multi-token sequences."""

    decode_batches: tuple[DecodeBatch, ...]
    prefill_seq_idx: tuple[int, ...]  # sequences with more than one new token


class TorchAttentionBackend:
    """Today's SDPA path (see the module docstring); the oracle the Triton backend matches."""

    name = "torch"
    # `forward` loops in Python over the plan's host values, which a graph would freeze.
    supports_capture = False

    def __init__(self, max_score_elements: int = MAX_SCORE_ELEMENTS) -> None:
        self.max_score_elements = max_score_elements

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
        layout = build_layout(query_lens, seq_lens, block_tables, block_size, device, self, buffers)
        return layout.with_plan(plan_decodes(layout, buffers))

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
        return paged_attention(
            query, key, value, kv_cache, metadata, scale, self.max_score_elements
        )

    def init_capture(
        self,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        raise ValueError(
            "the torch attention backend cannot be captured into CUDA graphs; "
            "--attention-backend triton can"
        )

    def prepare_for_capture(self, num_seqs: int) -> AttentionMetadata:
        raise ValueError("the torch attention backend cannot be captured into CUDA graphs")

    def prepare_for_replay(self, metadata: AttentionMetadata, num_seqs: int) -> bool:
        raise ValueError("the torch attention backend cannot be captured into CUDA graphs")


def plan_decodes(metadata: AttentionMetadata, buffers: AttentionBuffers | None = None) -> TorchPlan:
    """Group the one-token sequences by length (see `_decode_groups`), on the host; each
    group's indices are one slice of the plan buffers (written group after group)."""
    loc, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    block_size = metadata.block_size
    decode_idx = [i for i in range(metadata.num_seqs) if loc[i + 1] - loc[i] == 1]
    blocks = [-(-seq_lens[i] // block_size) for i in decode_idx]
    groups = [[decode_idx[m] for m in members] for members in _decode_groups(blocks)]
    buffers = plan_buffers(metadata, buffers)
    ordered = [i for seqs in groups for i in seqs]
    buffers.decode_seq_idx.host_view(len(ordered))[:] = ordered
    buffers.decode_token_idx.host_view(len(ordered))[:] = [loc[i] for i in ordered]
    seq_idx = buffers.decode_seq_idx.push(len(ordered)).to(metadata.block_tables.device)
    token_idx = buffers.decode_token_idx.push(len(ordered)).to(metadata.block_tables.device)
    max_blocks = {i: b for i, b in zip(decode_idx, blocks, strict=True)}
    batches, start = [], 0
    for seqs in groups:
        end = start + len(seqs)
        batches.append(
            DecodeBatch(
                seq_idx=seq_idx[start:end],
                token_idx=token_idx[start:end],
                max_blocks=max(max_blocks[i] for i in seqs),
            )
        )
        start = end
    prefill = tuple(i for i in range(metadata.num_seqs) if loc[i + 1] - loc[i] > 1)
    return TorchPlan(tuple(batches), prefill)


def _gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, num_keys: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [num_keys, num_kv_heads, head_dim] of one sequence, read through its blocks."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    key = kv_cache[0, block_ids].reshape(-1, num_kv_heads, head_dim)[:num_keys]
    value = kv_cache[1, block_ids].reshape(-1, num_kv_heads, head_dim)[:num_keys]
    return key, value


def _attend_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    max_score_elements: int,
) -> torch.Tensor:
    """Causal attention of one sequence's last q_len tokens over all its seq_len keys.

    query [q_len, num_heads, head_dim], key/value [seq_len, num_kv_heads, head_dim] (GQA: each
    KV head serves num_heads / num_kv_heads query heads).
    """
    q_len, num_heads, _ = query.shape
    seq_len = key.shape[0]
    context_len = seq_len - q_len
    q = query.transpose(0, 1).unsqueeze(0)  # [1, num_heads, q_len, head_dim]
    k = key.transpose(0, 1).unsqueeze(0)  # [1, num_heads, seq_len, head_dim]
    v = value.transpose(0, 1).unsqueeze(0)
    if 4 * context_len <= q_len and seq_len * seq_len * num_heads <= max_score_elements:
        # Causal with is_causal, which skips the masked half. SDPA aligns that mask top-left,
        # so with a few earlier tokens (a prefix-cache hit of the template's first block) the
        # queries are led by context_len zero rows: query row context_len + i then sees keys
        # 0..context_len + i, its own causal row, bit for bit what the mask below gives. The
        # lead rows cost little while context_len <= q_len / 4 (measured on CPU: 346 new
        # tokens after 16 -12%, 2048 after 512 -45%; at a third or more the mask was faster).
        if context_len:
            q = torch.cat((q.new_zeros(1, num_heads, context_len, q.shape[-1]), q), dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=num_heads != k.shape[1]
        )
        return out[:, :, context_len:].squeeze(0).transpose(0, 1)
    chunk = max(1, max_score_elements // (seq_len * num_heads))
    key_pos = torch.arange(seq_len, device=query.device)
    outs = []
    for start in range(0, q_len, chunk):
        end = min(start + chunk, q_len)
        query_pos = torch.arange(context_len + start, context_len + end, device=query.device)
        mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # [chunk, seq_len] True = attend
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, start:end],
                k,
                v,
                attn_mask=mask,
                scale=scale,
                enable_gqa=num_heads != k.shape[1],
            )
        )
    return torch.cat(outs, dim=2).squeeze(0).transpose(0, 1)


def _attend_decodes(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_queries_per_kv: int,
    scale: float,
) -> torch.Tensor:
    """One new token per sequence, all sequences in one SDPA call over padded keys.

    query [n, num_heads, head_dim]; block_tables [n, max_blocks]; seq_lens [n].
    """
    n, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    max_blocks = block_tables.shape[1]
    num_keys = max_blocks * block_size
    ids = block_tables.long()
    # [n, num_kv_heads, num_keys, head_dim]: keys of each sequence, read through its blocks
    flat_ids = ids.reshape(-1)
    key = kv_cache[0].index_select(0, flat_ids).view(n, num_keys, num_kv_heads, head_dim)
    value = kv_cache[1].index_select(0, flat_ids).view(n, num_keys, num_kv_heads, head_dim)
    key, value = key.transpose(1, 2), value.transpose(1, 2)
    key_pos = torch.arange(num_keys, device=query.device)
    mask = (key_pos.unsqueeze(0) < seq_lens.unsqueeze(1)).view(n, 1, 1, -1)  # [n, 1, 1, keys]
    # GQA without copying K/V: the query heads that share a KV head become that head's
    # "query rows" ([n, num_kv_heads, group, head_dim]); head h = kv_head * group + g.
    q = query.view(n, num_kv_heads, num_queries_per_kv, head_dim)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
    return out.reshape(n, num_heads, head_dim)


def _decode_groups(num_blocks: list[int], min_saving: float = 0.2) -> list[list[int]]:
    """Indices of decode sequences in groups of similar length, so that padding every sequence
    to its group's longest wastes little; num_blocks[i] = blocks sequence i reads.

    Sorted by length, a group is cut in two where that saves the most padded blocks, as long
    as the saving is at least `min_saving` of the group's padded size (each group costs a few
    more kernel launches).
    """
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__)
    pending, groups = ([order] if order else []), []
    while pending:
        group = pending.pop()
        sizes = [num_blocks[i] for i in group]
        padded = len(group) * sizes[-1]
        best_cut, best_cost = 0, padded
        for cut in range(1, len(group)):
            cost = cut * sizes[cut - 1] + (len(group) - cut) * sizes[-1]
            if cost < best_cost:
                best_cut, best_cost = cut, cost
        if best_cut and padded - best_cost >= max(4, min_saving * padded):
            pending += [group[:best_cut], group[best_cut:]]
        else:
            groups.append(group)
    return groups


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    max_score_elements: int = MAX_SCORE_ELEMENTS,
) -> torch.Tensor:
    """Write the new tokens' K/V into `kv_cache`, then attend causally through the block tables.

    query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads, head_dim]
    (already rotated). Returns [num_tokens, num_heads, head_dim] in the cache's dtype.
    `max_score_elements` bounds the score matrix of one prefill SDPA call (queries are chunked).
    `metadata` comes from `TorchAttentionBackend.build_metadata` (its plan is a `TorchPlan`).
    """
    plan = metadata.plan
    assert isinstance(plan, TorchPlan), "metadata built by another backend"
    write_kv_cache(kv_cache, key, value, metadata.slot_mapping, skip_negative=metadata.has_padding)
    num_heads = query.shape[1]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    assert block_size == metadata.block_size, "the cache's block size differs from the metadata's"
    group = num_heads // num_kv_heads
    query = query.to(kv_cache.dtype)
    out = torch.empty_like(query)
    for batch in plan.decode_batches:
        out[batch.token_idx] = _attend_decodes(
            query[batch.token_idx],
            kv_cache,
            metadata.block_tables[batch.seq_idx, : batch.max_blocks],
            metadata.seq_lens[batch.seq_idx],
            group,
            scale,
        )
    loc, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    fresh_kv_exact = key.dtype == kv_cache.dtype and value.dtype == kv_cache.dtype
    for i in plan.prefill_seq_idx:
        start, end = loc[i], loc[i + 1]
        if fresh_kv_exact and seq_lens[i] == end - start:
            # no earlier tokens: its keys are this step's, the very values just written
            k, v = key[start:end], value[start:end]
        else:
            num_blocks = -(-seq_lens[i] // block_size)
            block_ids = metadata.block_tables[i, :num_blocks].long()
            k, v = _gather_kv(kv_cache, block_ids, seq_lens[i])
        out[start:end] = _attend_prefill(query[start:end], k, v, scale, max_score_elements)
    return out
