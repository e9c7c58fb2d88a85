"""The vision tower of Qwen2-VL and Qwen2.5-VL: patch embedding, ViT blocks, 2x2 patch merger.

Input is the CPU stage's flattened patches, many images (or video clips) concatenated:
`pixel_values [sum(t*h*w), C*T*P*P]` with `grid_thw` per item. Patches of an item come in
merge-block order (each 2x2 group of neighbouring patches is consecutive), so the merger is a
reshape. Attention is bidirectional within a segment and never crosses segments:

- Qwen2-VL: a segment is one frame of one item (h*w patches).
- Qwen2.5-VL: blocks in `fullatt_block_indexes` use frames as above; the others use windows of
  `window_size` pixels. Tokens are reordered once so that every window is contiguous, and the
  merger's output is put back in the original order at the end.

Attention runs through torch SDPA over batches of equal-length segments, with queries chunked
so that no [N, N] score matrix of a large image is ever materialised.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.layers.activation import get_activation
from mmserve.layers.norm import RMSNorm
from mmserve.layers.rotary import VisionRotaryEmbedding, apply_rotary
from mmserve.models.config import VisionConfig

# Max attention-score elements per SDPA call (segments x heads x queries x keys): 1 GiB of
# float32 should a math kernel materialise them. A 3840x2160 image (42,196 patches, 16 heads)
# runs in chunks of ~400 queries.
MAX_SCORE_ELEMENTS = 1 << 28


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens: Sequence[int],
    scale: float,
    max_score_elements: int = MAX_SCORE_ELEMENTS,
) -> torch.Tensor:
    """Bidirectional attention within consecutive segments of `seqlens` tokens.

    q, k, v [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]. Segments of
    equal length are batched in one SDPA call (windows of one size are the common case);
    long segments have their queries chunked to stay under `max_score_elements`.
    """
    num_heads = q.shape[1]
    by_len: dict[int, list[int]] = defaultdict(list)
    start = 0
    for length in seqlens:
        if length:
            by_len[length].append(start)
        start += length
    out = torch.empty_like(q)
    for length, starts in by_len.items():
        per_segment = num_heads * length * length
        segs_per_call = max(1, max_score_elements // per_segment)
        q_chunk = length
        if per_segment > max_score_elements:
            q_chunk = max(1, max_score_elements // (num_heads * length))
        offsets = torch.arange(length, device=q.device)
        for i in range(0, len(starts), segs_per_call):
            group = torch.tensor(starts[i : i + segs_per_call], device=q.device)
            idx = group.unsqueeze(1) + offsets  # [num_segments, length]
            qs = q[idx].transpose(1, 2)  # [num_segments, num_heads, length, head_dim]
            ks = k[idx].transpose(1, 2)
            vs = v[idx].transpose(1, 2)
            chunks = [
                F.scaled_dot_product_attention(qs[:, :, s : s + q_chunk], ks, vs, scale=scale)
                for s in range(0, length, q_chunk)
            ]
            out[idx] = torch.cat(chunks, dim=2).transpose(1, 2)
    return out


def vision_hw_positions(
    grid_thw: Sequence[tuple[int, int, int]], merge: int, device: torch.device
) -> torch.Tensor:
    """(row, col) of every patch in merge-block order, items concatenated: [num_patches, 2]."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h, device=device).view(h, 1).expand(h, w)
        cols = torch.arange(w, device=device).view(1, w).expand(h, w)
        # [h/m, m, w/m, m] -> [h/m, w/m, m, m]: neighbours of one 2x2 block become consecutive
        rows = rows.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten()
        cols = cols.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_order(
    grid_thw: Sequence[tuple[int, int, int]], merge: int, window_merged: int
) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL windows: a permutation of merged tokens making each window contiguous.

    Returns (window_index [num_merged_tokens] on CPU, window lengths in patches). Windows are
    `window_merged` x `window_merged` merged tokens, tiled from the top-left of each frame,
    frames in order, windows row-major, tokens row-major inside a window; edge windows are cut.
    """
    indices, seqlens = [], []
    offset = 0
    for t, h, w in grid_thw:
        lh, lw = h // merge, w // merge
        ids = torch.arange(t * lh * lw).view(t, lh, lw)
        pad_h, pad_w = (-lh) % window_merged, (-lw) % window_merged
        ids = F.pad(ids, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (lh + pad_h) // window_merged, (lw + pad_w) // window_merged
        # [t, nh, win, nw, win] -> [t * nh * nw, win * win]
        ids = ids.view(t, nh, window_merged, nw, window_merged).permute(0, 1, 3, 2, 4)
        ids = ids.reshape(t * nh * nw, window_merged * window_merged)
        valid = ids >= 0
        indices.append(ids[valid] + offset)
        seqlens.extend(int(c) * merge * merge for c in valid.sum(1).tolist() if c)
        offset += t * lh * lw
    return torch.cat(indices), seqlens


class PatchEmbed(nn.Module):
    """Conv3d with kernel = stride = (T, P, P), i.e. a Linear over each flattened patch."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.embed_dim, kernel, kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.flatten(1)  # [embed_dim, C*T*P*P], same order as the patches
        return F.linear(pixel_values.to(weight.dtype), weight)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim, bias=True)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: Sequence[int]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = segment_attention(q, k, v, seqlens, self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    """Qwen2-VL: fc1 -> act -> fc2."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.embed_dim, config.mlp_hidden_dim)
        self.fc2 = nn.Linear(config.mlp_hidden_dim, config.embed_dim)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMLP(nn.Module):
    """Qwen2.5-VL: down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.embed_dim, config.mlp_hidden_dim)
        self.up_proj = nn.Linear(config.embed_dim, config.mlp_hidden_dim)
        self.down_proj = nn.Linear(config.mlp_hidden_dim, config.embed_dim)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _norm(config: VisionConfig, dim: int) -> nn.Module:
    return RMSNorm(dim, eps=1e-6) if config.is_windowed else nn.LayerNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = _norm(config, config.embed_dim)
        self.norm2 = _norm(config, config.embed_dim)
        self.attn = VisionAttention(config)
        self.mlp = VisionGatedMLP(config) if config.is_windowed else VisionMLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: Sequence[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seqlens)
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
    """pixel_values [num_patches, C*T*P*P] + grid_thw -> embeddings [num_patches / m^2, out_dim]."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.rotary = VisionRotaryEmbedding(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:
        cfg = self.config
        merge_unit = cfg.spatial_merge_size**2
        x = self.patch_embed(pixel_values)  # [num_patches, embed_dim]
        positions = vision_hw_positions(grid_thw, cfg.spatial_merge_size, x.device)
        cos, sin = self.rotary(positions)  # [num_patches, head_dim] float32
        frame_seqlens = [h * w for t, h, w in grid_thw for _ in range(t)]
        window_seqlens = frame_seqlens
        window_index = None
        if cfg.is_windowed:
            window_merged = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
            window_index, window_seqlens = window_order(
                grid_thw, cfg.spatial_merge_size, window_merged
            )
            window_index = window_index.to(x.device)
            # Permute whole 2x2 groups, so the merger still sees neighbours consecutively.
            x, cos, sin = (
                t.view(-1, merge_unit, t.shape[-1])[window_index].view(-1, t.shape[-1])
                for t in (x, cos, sin)
            )
        for layer_idx, block in enumerate(self.blocks):
            full = not cfg.is_windowed or layer_idx in cfg.fullatt_block_indexes
            x = block(x, cos, sin, frame_seqlens if full else window_seqlens)
        merged = self.merger(x)  # [num_patches / merge_unit, out_dim]
        if window_index is not None:
            merged = merged[torch.argsort(window_index)]
        return merged
