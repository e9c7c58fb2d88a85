"""The paged KV cache a model needs: its shape, its bytes per block, its allocation."""

from __future__ import annotations

import torch

from mmserve.models.config import ModelConfig


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
