"""The vision tower of Qwen3-VL: patch embedding + learned positions, ViT blocks, mergers.

Same input as the Qwen2-VL tower (`qwen2_vl_vision.py`): flattened patches of many items in
merge-block order, `pixel_values [sum(t*h*w), C*T*P*P]` with `grid_thw` per item. It differs:

- the patch embedding has a bias, and a learned absolute position table (side x side entries,
  `num_position_embeddings`) is bilinearly resampled (align_corners) to each item's h x w grid
  and added to every frame's patches, on top of the blocks' 2-D rotary;
- blocks are LayerNorm + GELU(tanh) MLP with biases, full attention within each frame;
- DeepStack: the outputs of the blocks in `deepstack_visual_indexes` go through their own
  mergers (norm after the 2x2 concatenation); each is one more level of the item's embedding.

The output is one row per merged token: `[main, level 0, level 1, ...]` concatenated along the
last dim, `[num_tokens, out_dim * (1 + levels)]` (`ModelConfig.mm_embedding_width`).

The resampling taps, like the attention segments and rotary positions, are built on the host
before the blocks run (`build_metadata`), so `encode` reads tensors only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.layers.activation import get_activation
from mmserve.layers.attention.vision import VisionAttentionMetadata
from mmserve.layers.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TPGroup
from mmserve.layers.rotary import VisionRotaryEmbedding
from mmserve.models.config import VisionConfig
from mmserve.models.qwen2_vl_vision import (
    PatchEmbed,
    VisionAttention,
    check_vision_attention,
    uses_varlen,
)
from mmserve.models.vision_metadata import (
    PaddedShape,
    build_vision_metadata,
    vision_hw_positions,
)


@dataclass(frozen=True)
class Qwen3VisionMetadata:
    """One tower call's host-built inputs: attention segments and rotary positions (`attn`),
    and the position table's bilinear taps: `table_index` [num_patches, 4] int64 rows of the
    table, `table_weight` [num_patches, 4] float32 (padding patches: weight 0)."""

    attn: VisionAttentionMetadata
    table_index: torch.Tensor
    table_weight: torch.Tensor


def _axis_taps(
    index: torch.Tensor, size: torch.Tensor, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (floor, floor + 1, clamped) on a `side`-long table axis for positions
    `index` of an axis `size` long, align_corners (the ends map to 0 and side - 1): [n, 2] each."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_table_taps(
    grid_thw: Sequence[tuple[int, int, int]], side: int, merge: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, weight), each [num_patches, 4] on the host: every patch's (row, col), in the
    tower's merge-block order, resampled from a side x side table (transformers'
    `interpolate(mode="bilinear", align_corners=True)`). Taps in order (h0 w0, h0 w1, h1 w0,
    h1 w1)."""
    rows_cols = vision_hw_positions(grid_thw, merge, "cpu")  # [num_patches, 2]
    counts = torch.tensor([t * h * w for t, h, w in grid_thw], dtype=torch.int64)
    sizes = torch.tensor([[h, w] for _, h, w in grid_thw], dtype=torch.int64).view(-1, 2)
    sizes = sizes.repeat_interleave(counts, dim=0)  # [num_patches, 2]: its item's (h, w)
    h_taps, h_weights = _axis_taps(rows_cols[:, 0], sizes[:, 0], side)
    w_taps, w_weights = _axis_taps(rows_cols[:, 1], sizes[:, 1], side)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return index, weight


class VisionMLP(nn.Module):
    """linear_fc1 -> act -> linear_fc2 (column- then row-parallel with a group)."""

    def __init__(self, config: VisionConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear.split(
            config.embed_dim, config.mlp_hidden_dim, bias=True, tp=tp, what="vision MLP width"
        )
        self.linear_fc2 = RowParallelLinear(
            config.mlp_hidden_dim, config.embed_dim, bias=True, tp=tp, what="vision MLP width"
        )
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.attn = VisionAttention(config, tp)
        self.mlp = VisionMLP(config, tp)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: VisionAttentionMetadata
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, meta.full, meta.use_varlen)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2x2 block of neighbouring patches to one token of the LM's width. The main merger
    norms each patch before the concatenation; a DeepStack merger (`postshuffle_norm`) norms
    the concatenation."""

    def __init__(self, config: VisionConfig, postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged_dim = config.embed_dim * config.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle_norm else config.embed_dim, 1e-6)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.linear_fc2 = nn.Linear(self.merged_dim, config.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.merged_dim))
        else:
            x = self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    """pixel_values [num_patches, C*T*P*P] + grid_thw -> [num_patches / m^2, out_dim * (1 + L)].

    `attention` as in the Qwen2-VL tower ("auto", "reference", "varlen"); `tp` splits the
    blocks' heads and MLPs (`--mm-encoder-tp-mode weights`); the patch embedding, position
    table and mergers (main and DeepStack) stay whole on every rank.
    """

    def __init__(self, config: VisionConfig, attention: str = "auto", tp: TPGroup = SINGLE) -> None:
        super().__init__()
        if config.model_type != "qwen3_vl":
            raise ValueError(f"Qwen3VisionTransformer needs a qwen3_vl config, got {config}")
        self.config = config
        self.attention = check_vision_attention(attention)
        self.patch_embed = PatchEmbed(config, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.embed_dim)
        self.rotary = VisionRotaryEmbedding(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList([VisionBlock(config, tp) for _ in range(config.depth)])
        self.merger = PatchMerger(config, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(config, postshuffle_norm=True) for _ in config.deepstack_visual_indexes]
        )
        # block index -> its DeepStack level
        self._levels = {block: level for level, block in enumerate(config.deepstack_visual_indexes)}

    def uses_varlen(self, device: torch.device | str, dtype: torch.dtype) -> bool:
        return uses_varlen(self.attention, device, dtype, self.config.head_dim)

    def build_metadata(
        self,
        grid_thw: Sequence[tuple[int, int, int]],
        device: torch.device | str,
        padded: PaddedShape | None = None,
    ) -> Qwen3VisionMetadata:
        """The host-side part of a call: segments, rotary positions, the table's taps."""
        cfg = self.config
        dtype = self.patch_embed.proj.weight.dtype
        use_varlen = self.uses_varlen(device, dtype)
        attn = build_vision_metadata(grid_thw, cfg, device, use_varlen=use_varlen, padded=padded)
        index, weight = position_table_taps(
            grid_thw, cfg.position_table_side, cfg.spatial_merge_size
        )
        pad = attn.positions.shape[0] - index.shape[0]
        index = torch.cat([index, index.new_zeros(pad, 4)])
        weight = torch.cat([weight, weight.new_zeros(pad, 4)])
        return Qwen3VisionMetadata(attn, index.to(device), weight.to(device))

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:
        return self.encode(pixel_values, self.build_metadata(grid_thw, pixel_values.device))

    def encode(self, pixel_values: torch.Tensor, meta: Qwen3VisionMetadata) -> torch.Tensor:
        """The device-side part: reads tensors only."""
        x = self.patch_embed(pixel_values)  # [num_patches, embed_dim]
        # [num_patches, 4, embed_dim] taps, weighted in float32, summed
        table = F.embedding(meta.table_index, self.pos_embed.weight)
        x = x + (table * meta.table_weight[:, :, None]).sum(1).to(x.dtype)
        cos, sin = self.rotary(meta.attn.positions)  # [num_patches, head_dim] float32
        levels: list[torch.Tensor] = []
        for block_idx, block in enumerate(self.blocks):
            x = block(x, cos, sin, meta.attn)
            level = self._levels.get(block_idx)
            if level is not None:  # [num_patches / m^2, out_dim]
                levels.append(self.deepstack_merger_list[level](x))
        main = self.merger(x)  # [num_patches / m^2, out_dim]
        return torch.cat([main, *levels], dim=-1) if levels else main
