"""The paged KV cache: its shape, its size per block, allocation, the reference store."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mmserve.models.config import ModelConfig


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
