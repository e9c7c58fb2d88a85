"""The reference KV store: new tokens' keys and values written at their cache slots."""

from __future__ import annotations

import torch


def write_kv_cache(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    skip_negative: bool = False,
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots (in place).

    `skip_negative`: the batch has padding tokens (slot -1) that must not be stored. Indexing
    with -1 would write the cache's last slot, a real block's; the filter costs a host sync
    on CUDA, so only a padded batch pays it (the Triton store skips them for free)."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    if skip_negative:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slot_mapping] = key.to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slot_mapping] = value.to(kv_cache.dtype)
