"""The paged KV cache a model needs: its shape, its bytes per block, its allocation.

With tensor parallelism each rank caches only its own KV heads (`split_heads`: the model's KV
heads divided by the group's size, or one replicated head when the size exceeds them), so every
figure here is per rank.
"""

from __future__ import annotations

import torch

from mmserve.layers.parallel import SINGLE, TPGroup, split_heads
from mmserve.models.config import ModelConfig


def kv_cache_shape(
    model_config: ModelConfig, num_blocks: int, block_size: int, tp: TPGroup = SINGLE
) -> tuple[int, int, int, int, int]:
    """[2, num_blocks, block_size, this rank's KV heads, head_dim]."""
    text = model_config.text
    heads = split_heads(text.num_attention_heads, text.num_key_value_heads, tp)
    return (2, num_blocks, block_size, heads.num_kv_heads, text.head_dim)


def kv_cache_bytes_per_block(
    model_config: ModelConfig, block_size: int, dtype: torch.dtype, tp: TPGroup = SINGLE
) -> int:
    """Bytes one KV block costs this rank across all decoder layers (keys and values)."""
    _, _, _, num_kv_heads, head_dim = kv_cache_shape(model_config, 1, block_size, tp)
    element_bytes = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * num_kv_heads * head_dim * element_bytes
    return per_layer * model_config.text.num_hidden_layers


def allocate_kv_caches(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
    tp: TPGroup = SINGLE,
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per decoder layer
    (this rank's KV heads)."""
    shape = kv_cache_shape(model_config, num_blocks, block_size, tp)
    return [
        torch.zeros(shape, dtype=dtype, device=device)
        for _ in range(model_config.text.num_hidden_layers)
    ]
