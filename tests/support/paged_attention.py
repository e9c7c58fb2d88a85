"""Paged attention over scattered blocks checked against dense causal attention."""

from __future__ import annotations

import random

import torch

from mmserve.layers.attention import TorchAttentionBackend, paged_attention, write_kv_cache


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference in float64 with an explicit softmax: q [q_len, H, D], k/v [seq_len, Hkv, D]."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
    allowed = torch.arange(seq_len, device=q.device).unsqueeze(0) <= query_pos
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def check_paged_equals_dense(
    dtype: torch.dtype,
    atol: float,
    seed: int,
    max_score_elements: int,
    device: str,
    head_dim: int = 16,
) -> None:
    """A mixed batch over scattered blocks equals dense causal attention, sequence by sequence."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_heads, num_kv_heads, block_size, num_blocks = 4, 2, 4, 64
    # (cached tokens, new tokens): fresh prefills, prefill chunks on top of a context, decodes
    shapes = [(0, 9), (5, 1), (13, 6), (0, 1), (20, 1), (3, 17), (31, 1)]
    rng.shuffle(shapes)
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered, non-monotonic block ids
    kv_cache = torch.zeros(
        2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )
    tables, full_k, full_v = [], [], []
    for cached, new in shapes:
        n = cached + new
        tables.append([free.pop() for _ in range(-(-n // block_size))])
        full_k.append(torch.randn(n, num_kv_heads, head_dim).to(device, dtype))
        full_v.append(torch.randn(n, num_kv_heads, head_dim).to(device, dtype))
        if cached:  # an earlier step wrote the context
            meta = TorchAttentionBackend().build_metadata(
                [cached], [cached], [tables[-1]], block_size, device
            )
            write_kv_cache(kv_cache, full_k[-1][:cached], full_v[-1][:cached], meta.slot_mapping)
    q_lens = [new for _, new in shapes]
    seq_lens = [c + new for c, new in shapes]
    meta = TorchAttentionBackend().build_metadata(q_lens, seq_lens, tables, block_size, device)
    query = torch.randn(sum(q_lens), num_heads, head_dim).to(device, dtype)
    key = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes, strict=True)])
    value = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes, strict=True)])
    scale = head_dim**-0.5
    out = paged_attention(query, key, value, kv_cache, meta, scale, max_score_elements)
    assert out.shape == query.shape and out.dtype == dtype and out.device == query.device
    loc = meta.query_start_loc_cpu
    for i in range(len(shapes)):
        ref = _dense_causal(query[loc[i] : loc[i + 1]], full_k[i], full_v[i], scale)
        torch.testing.assert_close(out[loc[i] : loc[i + 1]].double(), ref, atol=atol, rtol=0)
