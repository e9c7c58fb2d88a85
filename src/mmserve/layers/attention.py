"""Paged-KV causal attention for a flattened batch of many requests (prefill chunks and decodes).

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

The path here is a reference implementation (torch SDPA, any device, any float dtype):
correct for any block layout; decodes are batched into one SDPA call per group of sequences of
similar length (little padding), prefill chunks run one sequence at a time with their queries
cut into chunks to bound the score matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from mmserve.models.config import ModelConfig

# Upper bound on attention-score elements (heads x queries x keys) per SDPA call of the prefill
# path, so that a fallback math kernel never materialises a huge matrix (1 GiB in float32).
MAX_SCORE_ELEMENTS = 1 << 28


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each new token's K/V goes and which cached tokens each sequence reads.

    Tensors live on the model's device; `query_start_loc_cpu` / `seq_lens_cpu` are host copies
    (filled from the tensors when not given) so that the per-sequence loop never syncs.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32: block ids per sequence
    seq_lens: torch.Tensor  # [num_seqs] int32: tokens of each sequence after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative new-token counts
    query_start_loc_cpu: tuple[int, ...] = field(default=())
    seq_lens_cpu: tuple[int, ...] = field(default=())
    # decode_batches(block_size), worked out once per step and shared by every layer
    _decode_batches: dict[int, list[DecodeBatch]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.query_start_loc_cpu:
            object.__setattr__(
                self, "query_start_loc_cpu", tuple(int(x) for x in self.query_start_loc.tolist())
            )
        if not self.seq_lens_cpu:
            object.__setattr__(self, "seq_lens_cpu", tuple(int(x) for x in self.seq_lens.tolist()))
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

    def decode_batches(self, block_size: int) -> list[DecodeBatch]:
        """The one-token sequences, grouped by length (see `_decode_groups`)."""
        if block_size not in self._decode_batches:
            loc, seq_lens = self.query_start_loc_cpu, self.seq_lens_cpu
            decode_idx = [i for i in range(self.num_seqs) if loc[i + 1] - loc[i] == 1]
            blocks = [-(-seq_lens[i] // block_size) for i in decode_idx]
            device = self.block_tables.device
            batches = []
            for members in _decode_groups(blocks):
                seqs = [decode_idx[m] for m in members]
                batches.append(
                    DecodeBatch(
                        seq_idx=torch.tensor(seqs, device=device),
                        token_idx=torch.tensor([loc[i] for i in seqs], device=device),
                        max_blocks=max(blocks[m] for m in members),
                    )
                )
            self._decode_batches[block_size] = batches
        return self._decode_batches[block_size]


@dataclass(frozen=True)
class DecodeBatch:
    """Decode sequences attended in one SDPA call, their keys padded to `max_blocks` blocks."""

    seq_idx: torch.Tensor  # [n] int64: rows of the metadata's per-sequence tensors
    token_idx: torch.Tensor  # [n] int64: the sequences' new tokens in the flat batch
    max_blocks: int


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """AttentionMetadata from python lists: per sequence, its new-token count, its total length
    after this step, and its block ids (which must cover `seq_len` tokens)."""
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError("query_lens, seq_lens and block_tables need one entry per sequence")
    slots: list[int] = []
    starts = [0]
    for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if not 0 < q_len <= seq_len:
            raise ValueError(f"need 0 < query_len <= seq_len, got {q_len} and {seq_len}")
        if len(table) * block_size < seq_len:
            raise ValueError(
                f"block table of {len(table)} blocks holds {len(table) * block_size} tokens, "
                f"fewer than seq_len={seq_len}"
            )
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + q_len)
    max_blocks = max((len(t) for t in block_tables), default=0)
    padded = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(-1, max_blocks),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        query_start_loc_cpu=tuple(starts),
        seq_lens_cpu=tuple(int(s) for s in seq_lens),
    )


def write_kv_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots (in place)."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slot_mapping] = key.to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slot_mapping] = value.to(kv_cache.dtype)


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
    q = query.transpose(0, 1).unsqueeze(0)  # [1, num_heads, q_len, head_dim]
    k = key.transpose(0, 1).unsqueeze(0)  # [1, num_heads, seq_len, head_dim]
    v = value.transpose(0, 1).unsqueeze(0)
    if q_len == seq_len and q_len * seq_len * num_heads <= max_score_elements:
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=num_heads != k.shape[1]
        )
        return out.squeeze(0).transpose(0, 1)
    context_len = seq_len - q_len
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
    """
    write_kv_cache(kv_cache, key, value, metadata.slot_mapping)
    num_heads = query.shape[1]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    query = query.to(kv_cache.dtype)
    out = torch.empty_like(query)
    for batch in metadata.decode_batches(block_size):
        out[batch.token_idx] = _attend_decodes(
            query[batch.token_idx],
            kv_cache,
            metadata.block_tables[batch.seq_idx, : batch.max_blocks],
            metadata.seq_lens[batch.seq_idx],
            group,
            scale,
        )
    loc, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    for i in range(metadata.num_seqs):
        start, end = loc[i], loc[i + 1]
        if end - start <= 1:
            continue
        num_blocks = -(-seq_lens[i] // block_size)
        k, v = _gather_kv(kv_cache, metadata.block_tables[i, :num_blocks].long(), seq_lens[i])
        out[start:end] = _attend_prefill(query[start:end], k, v, scale, max_score_elements)
    return out


def kv_cache_shape(
    model_config: ModelConfig, num_blocks: int, block_size: int
) -> tuple[int, int, int, int, int]:
    text = model_config.text
    return (2, num_blocks, block_size, text.num_key_value_heads, text.head_dim)


def kv_cache_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block costs across all decoder layers (keys and values)."""
    _, _, _, num_kv_heads, head_dim = kv_cache_shape(model_config, 1, block_size)
    element_bytes = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * num_kv_heads * head_dim * element_bytes
    return per_layer * model_config.text.num_hidden_layers


def allocate_kv_caches(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per decoder layer."""
    shape = kv_cache_shape(model_config, num_blocks, block_size)
    return [
        torch.zeros(shape, dtype=dtype, device=device)
        for _ in range(model_config.text.num_hidden_layers)
    ]
