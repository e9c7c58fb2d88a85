"""The vision tower of Qwen2-VL and Qwen2.5-VL: patch embedding, ViT blocks, 2x2 patch merger.

Input is the CPU stage's flattened patches, many images (or video clips) concatenated:
`pixel_values [sum(t*h*w), C*T*P*P]` with `grid_thw` per item. Patches of an item come in
merge-block order (each 2x2 group of neighbouring patches is consecutive), so the merger is a
reshape. Attention is bidirectional within a segment and never crosses segments:

- Qwen2-VL: a segment is one frame of one item (h*w patches).
- Qwen2.5-VL: blocks in `fullatt_block_indexes` use frames as above; the others use windows of
  `window_size` pixels. Tokens are reordered once so that every window is contiguous, and the
  merger's output is put back in the original order at the end.

Attention runs once per call over packed segments (`layers/attention/vision.py`): flash
attention over `cu_seqlens` on CUDA in half precision, else the SDPA reference; the segments,
positions and window permutation are built on the host before the blocks run
(`vision_metadata.py`), so `encode` reads tensors only and can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.layers.activation import get_activation
from mmserve.layers.attention.vision import (
    MAX_SCORE_ELEMENTS,
    Segments,
    VisionAttentionMetadata,
    has_varlen,
    segment_attention,
    vision_attention,
)
from mmserve.layers.norm import RMSNorm
from mmserve.layers.parallel import (
    SINGLE,
    ColumnParallelLinear,
    HeadSplit,
    RowParallelLinear,
    TPGroup,
    split_evenly,
)
from mmserve.layers.rotary import VisionRotaryEmbedding, apply_rotary
from mmserve.models.config import VisionConfig
from mmserve.models.vision_metadata import (
    PaddedShape,
    build_vision_metadata,
    vision_hw_positions,
    window_order,
)

__all__ = [
    "MAX_SCORE_ELEMENTS",
    "VisionTransformer",
    "segment_attention",
    "vision_hw_positions",
    "window_order",
]
VISION_ATTENTION = ("auto", "reference", "varlen")


def check_vision_attention(attention: str) -> str:
    """A tower's `attention` setting, refused by name if unknown."""
    if attention not in VISION_ATTENTION:
        raise ValueError(f"vision attention must be one of {VISION_ATTENTION}, got {attention!r}")
    return attention


def uses_varlen(
    attention: str, device: torch.device | str, dtype: torch.dtype, head_dim: int
) -> bool:
    """Whether a tower with this `attention` setting runs flash varlen on `device` / `dtype`:
    "auto" where it can, "varlen" or an error naming why it cannot, "reference" never."""
    if attention == "auto":
        return has_varlen(device, dtype, head_dim)
    if attention == "varlen" and not has_varlen(device, dtype, head_dim):
        raise ValueError(
            f"varlen vision attention needs CUDA, float16/bfloat16, a head dim that is a "
            f"multiple of 8 up to 256 and a torch with torch.nn.attention.varlen; got "
            f"{device} {dtype}, head_dim {head_dim}"
        )
    return attention == "varlen"


class PatchEmbed(nn.Module):
    """Conv3d with kernel = stride = (T, P, P), i.e. a Linear over each flattened patch (with a
    bias in Qwen3-VL's tower)."""

    def __init__(self, config: VisionConfig, bias: bool = False) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.embed_dim, kernel, kernel, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.flatten(1)  # [embed_dim, C*T*P*P], same order as the patches
        return F.linear(pixel_values.to(weight.dtype), weight, self.proj.bias)


class VisionAttention(nn.Module):
    """Bidirectional attention over segments; with a group (`--mm-encoder-tp-mode weights`) the
    heads are split: the stacked [q|k|v] column-parallel, `proj` row-parallel (one all-reduce)."""

    def __init__(self, config: VisionConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.num_heads = split_evenly(config.num_heads, tp, "vision attention heads")
        self.head_dim = config.head_dim
        first = tp.rank * self.num_heads
        heads = HeadSplit(self.num_heads, first, self.num_heads, first, 1)
        total = (config.num_heads, config.num_heads)
        self.qkv = ColumnParallelLinear.qkv(
            config.embed_dim, self.head_dim, heads, total, None, bias=True, tp=tp
        )
        self.proj = RowParallelLinear(
            config.embed_dim, config.embed_dim, bias=True, tp=tp, what="vision embed_dim"
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: Segments,
        use_varlen: bool,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        scale = self.head_dim**-0.5
        out = vision_attention(q, k, v, segments, scale, use_varlen=use_varlen)
        return self.proj(out.reshape(n, -1))


def _mlp_in(config: VisionConfig, tp: TPGroup) -> ColumnParallelLinear:
    return ColumnParallelLinear.split(
        config.embed_dim, config.mlp_hidden_dim, bias=True, tp=tp, what="vision MLP width"
    )


def _mlp_out(config: VisionConfig, tp: TPGroup) -> RowParallelLinear:
    return RowParallelLinear(
        config.mlp_hidden_dim, config.embed_dim, bias=True, tp=tp, what="vision MLP width"
    )


class VisionMLP(nn.Module):
    """Qwen2-VL: fc1 -> act -> fc2 (column- then row-parallel with a group)."""

    def __init__(self, config: VisionConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.fc1 = _mlp_in(config, tp)
        self.fc2 = _mlp_out(config, tp)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMLP(nn.Module):
    """Qwen2.5-VL: down(act(gate(x)) * up(x)), with biases (gate, up column-parallel)."""

    def __init__(self, config: VisionConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.gate_proj = _mlp_in(config, tp)
        self.up_proj = _mlp_in(config, tp)
        self.down_proj = _mlp_out(config, tp)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _norm(config: VisionConfig, dim: int) -> nn.Module:
    return RMSNorm(dim, eps=1e-6) if config.is_windowed else nn.LayerNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.norm1 = _norm(config, config.embed_dim)
        self.norm2 = _norm(config, config.embed_dim)
        self.attn = VisionAttention(config, tp)
        self.mlp = VisionGatedMLP(config, tp) if config.is_windowed else VisionMLP(config, tp)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: Segments,
        use_varlen: bool,
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments, use_varlen)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm each patch, concatenate each 2x2 block of neighbours, project to the LM width."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.merged_dim = config.embed_dim * config.spatial_merge_size**2
        self.ln_q = _norm(config, config.embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim),
            nn.GELU(),
            nn.Linear(self.merged_dim, config.out_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


class VisionTransformer(nn.Module):
    """pixel_values [num_patches, C*T*P*P] + grid_thw -> embeddings [num_patches / m^2, out_dim].

    `attention`: "varlen" (flash attention over cu_seqlens: CUDA, half precision), "reference"
    (SDPA per group of equal segments, any device), or "auto" (varlen where it runs). `tp`: the
    group the blocks' heads and MLPs are split over (`--mm-encoder-tp-mode weights`); the patch
    embedding and the merger stay whole on every rank.
    """

    def __init__(self, config: VisionConfig, attention: str = "auto", tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.attention = check_vision_attention(attention)
        self.patch_embed = PatchEmbed(config)
        self.rotary = VisionRotaryEmbedding(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList([VisionBlock(config, tp) for _ in range(config.depth)])
        self.merger = PatchMerger(config)

    def uses_varlen(self, device: torch.device | str, dtype: torch.dtype) -> bool:
        return uses_varlen(self.attention, device, dtype, self.config.head_dim)

    def build_metadata(
        self,
        grid_thw: Sequence[tuple[int, int, int]],
        device: torch.device | str,
        padded: PaddedShape | None = None,
    ) -> VisionAttentionMetadata:
        """The host-side part of a call (see vision_metadata.py)."""
        dtype = self.patch_embed.proj.weight.dtype
        return build_vision_metadata(
            grid_thw,
            self.config,
            device,
            use_varlen=self.uses_varlen(device, dtype),
            padded=padded,
        )

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:
        return self.encode(pixel_values, self.build_metadata(grid_thw, pixel_values.device))

    def encode(self, pixel_values: torch.Tensor, meta: VisionAttentionMetadata) -> torch.Tensor:
        """The device-side part: reads tensors only (capturable when `meta.use_varlen`)."""
        cfg = self.config
        merge_unit = cfg.spatial_merge_size**2
        x = self.patch_embed(pixel_values)  # [num_patches, embed_dim]
        cos, sin = self.rotary(meta.positions)  # [num_patches, head_dim] float32
        if meta.window_index is not None:
            # Permute whole 2x2 groups, so the merger still sees neighbours consecutively.
            x = x.view(-1, merge_unit, x.shape[-1])[meta.window_index].view(-1, x.shape[-1])
        for layer_idx, block in enumerate(self.blocks):
            full = not cfg.is_windowed or layer_idx in cfg.fullatt_block_indexes
            x = block(x, cos, sin, meta.full if full else meta.windowed, meta.use_varlen)
        merged = self.merger(x)  # [num_patches / merge_unit, out_dim]
        if meta.window_inverse is not None:
            merged = merged[meta.window_inverse]
        return merged
