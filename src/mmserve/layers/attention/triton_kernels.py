"""Triton kernels of the paged KV cache: the store by slot mapping and paged attention.

Imported only by `triton_backend.py` (the torch backend never needs triton). The functions
below are plain Python until `compile_kernels` hands them to `triton.jit`: jitting at backend
construction, not at import, lets one process hold an interpreted backend (TRITON_INTERPRET=1,
on the CPU) and a compiled one. No `from __future__ import annotations` here: Triton reads the
`tl.constexpr` annotations as objects.

Paged attention, one launch per step for the whole flat batch. The grid is
(query tiles, KV heads). A tile is up to BLOCK_Q consecutive new tokens of one sequence (tiles
never cross sequences; the host plans them in `build_metadata`); its rows are those tokens
times the GROUP query heads that share the program's KV head (GQA: K/V are read once per group):

    row r of a tile:  token = q_start + r // GROUP_PAD,  head = kv_head * GROUP + r % GROUP_PAD
                      (rows with r % GROUP_PAD >= GROUP or token >= q_len are padding)

The program walks the sequence's blocks up to the tile's last query position, one KV block per
iteration, with an online softmax in float32 (running max `m`, normaliser `l`, accumulator).
Head dims that are not a power of two (24, 72, 80) are padded to the next one (HEAD_PAD: 32,
128, 128; at least 16, tl.dot's narrowest operand) and the tail is masked: loads read it as 0,
so it adds nothing to q.k, and stores skip it. `check_head_dim` bounds the head dim at start-up.

NOTE: a decode is a tile of one token, so a decode program's rows are mostly padding and one
program reads a whole sequence's KV serially. That is correct and simple; a split-K decode
kernel (partitions of the context reduced by a second kernel) and a decode-sized tile are the
later optimisations for long contexts at small batch.
"""

from typing import Any, NamedTuple

import triton
import triton.language as tl


def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
):
    """One program per new token: its K and V, every KV head, into the cache at its slot.
    A negative slot (a padding token) is skipped."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, KV_HEADS_PAD)[:, None]
        dims = tl.arange(0, HEAD_PAD)[None, :]
        mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
        dst = (
            block * stride_cache_block
            + offset * stride_cache_slot
            + heads * stride_cache_head
            + dims
        )
        key_off = token * stride_key_token + heads * stride_key_head + dims
        key = tl.load(key_ptr + key_off, mask=mask)
        tl.store(key_cache_ptr + dst, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
        value = tl.load(
            value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=mask
        )
        tl.store(value_cache_ptr + dst, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_seq_idx_ptr,
    tile_q_start_ptr,
    scale,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """Causal attention of one query tile over its sequence's paged keys (module docstring).
    DOT_IN_FP32 upcasts the dot operands: Triton 3.9's interpreter multiplies bfloat16 as raw
    uint16 bits, so under the interpreter bfloat16 inputs take the float32 dot."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_idx_ptr + tile)
    q_start = tl.load(tile_q_start_ptr + tile)  # the tile's first token, among seq's new ones
    seq_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - seq_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = q_start + rows // GROUP_PAD  # [BLOCK_M]
    head = kv_head * GROUP + rows % GROUP_PAD
    is_row = (token < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_PAD)
    is_dim = dims < HEAD_DIM
    query_row = (seq_begin + token)[:, None] * stride_query_token
    query_off = query_row + head[:, None] * stride_query_head
    query = tl.load(
        query_ptr + query_off + dims[None, :], mask=is_row[:, None] & is_dim[None, :], other=0.0
    )  # [BLOCK_M, HEAD_PAD]
    if DOT_IN_FP32:
        query = query.to(tl.float32)
    query_pos = context_len + token  # [BLOCK_M]: each row's position in its sequence

    m = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, tl.float32)  # finite: exp(m - m_new) is never NaN
    l = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_PAD], tl.float32)
    slots = tl.arange(0, BLOCK_SIZE)
    last_pos = context_len + tl.minimum(q_start + BLOCK_Q, q_len) - 1
    for j in range(0, last_pos // BLOCK_SIZE + 1):
        block_id = tl.load(block_tables_ptr + seq * stride_table_seq + j).to(tl.int64)
        key_pos = j * BLOCK_SIZE + slots  # [BLOCK_SIZE]
        kv_off = (
            block_id * stride_cache_block
            + slots[:, None] * stride_cache_slot
            + kv_head * stride_cache_head
            + dims[None, :]
        )
        # Slots past seq_len read as 0: whatever a freed block holds (even NaN) stays out.
        kv_mask = (key_pos < seq_len)[:, None] & is_dim[None, :]
        key = tl.load(key_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_SIZE, HEAD_PAD]
        value = tl.load(value_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            key, value = key.to(tl.float32), value.to(tl.float32)
        scores = tl.dot(query, tl.trans(key), input_precision=DOT_PRECISION) * scale
        scores = tl.where(key_pos[None, :] <= query_pos[:, None], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])  # [BLOCK_M, BLOCK_SIZE]
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        pv = tl.dot(p.to(value.dtype), value, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    out_off = (seq_begin + token)[:, None] * stride_out_token + head[:, None] * stride_out_head
    tl.store(
        out_ptr + out_off + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=is_row[:, None] & is_dim[None, :],
    )


class TritonKernels(NamedTuple):
    store_kv: Any  # triton.JITFunction, or an InterpretedFunction
    paged_attention: Any
    is_interpreted: bool


def compile_kernels() -> TritonKernels:
    """The kernels, jitted now (interpreted when TRITON_INTERPRET=1 is set at this moment)."""
    return TritonKernels(
        store_kv=triton.jit(_store_kv_kernel),
        paged_attention=triton.jit(_paged_attention_kernel),
        is_interpreted=bool(triton.knobs.runtime.interpret),
    )
