"""The Qwen2-VL / Qwen2.5-VL ViT's per-call metadata from `grid_thw`, exact or padded.

Built on the host before the tower runs (positions, frames, windows, the window permutation),
so that the blocks' forward reads tensors only. A padded call (a CUDA graph's fixed size) adds
patches after the real ones; they form segments of their own, so they never attend to a real
patch and a real patch never attends to them, and their outputs are dropped:

    patches:     | item 0 frames | item 1 frames | ... | padding (budget - n)                |
    frames:      | f0 | f1 | ...                     | one padding segment | empty ... empty |
    windows:     | w0 | w1 | ...                     | pad <= W | pad <= W | empty ... empty |

W is the patches of one full window, the longest a window layer ever attends over; the empty
segments keep the segment counts fixed for a budget (`PaddedShape`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmserve.grid import grid_num_patches
from mmserve.layers.attention.vision import VisionAttentionMetadata, make_segments
from mmserve.models.config import VisionConfig


@dataclass(frozen=True)
class PaddedShape:
    """The fixed layout of a padded call: its patches and its frame-segment slots (windows get
    `num_patches // merge_unit` slots: no segment is shorter than one 2x2 group)."""

    num_patches: int
    num_frame_segments: int

    def __post_init__(self) -> None:
        if self.num_patches < 1 or self.num_frame_segments < 1:
            raise ValueError(f"a padded shape needs patches and segments, got {self}")


def check_vision_inputs(
    pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]], config: VisionConfig
) -> list[tuple[int, int, int]]:
    """grid_thw as int triples, after checking it against the pixels' shape."""
    grids = [(int(g[0]), int(g[1]), int(g[2])) for g in grid_thw]
    num_patches = sum(grid_num_patches(grid) for grid in grids)
    if pixel_values.shape != (num_patches, config.patch_input_dim):
        raise ValueError(
            f"pixel_values has shape {tuple(pixel_values.shape)}, expected "
            f"({num_patches}, {config.patch_input_dim}) for grid_thw {grids}"
        )
    merge = config.spatial_merge_size
    for g in grids:
        if g[1] % merge or g[2] % merge:
            raise ValueError(f"grid_thw {g}: h and w must be multiples of {merge}")
    return grids


def vision_hw_positions(
    grid_thw: Sequence[tuple[int, int, int]], merge: int, device: torch.device | str
) -> torch.Tensor:
    """(row, col) of every patch in merge-block order, items concatenated: [num_patches, 2]."""
    out = [torch.zeros(0, 2, dtype=torch.int64, device=device)]
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
    indices, seqlens = [torch.zeros(0, dtype=torch.int64)], []
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


def window_patches(config: VisionConfig) -> int:
    """Patches of one full Qwen2.5-VL window (the longest window segment)."""
    merged = config.window_size // config.spatial_merge_size // config.patch_size
    return merged * merged * config.spatial_merge_size**2


def build_vision_metadata(
    grid_thw: Sequence[tuple[int, int, int]],
    config: VisionConfig,
    device: torch.device | str,
    *,
    use_varlen: bool = False,
    padded: PaddedShape | None = None,
) -> VisionAttentionMetadata:
    """The metadata of one tower call over `grid_thw`; with `padded`, of the call padded to it
    (`ValueError` if the items do not fit: too many patches or frames)."""
    merge = config.spatial_merge_size
    unit = merge * merge
    num_patches = sum(grid_num_patches(grid) for grid in grid_thw)
    frames = [h * w for t, h, w in grid_thw for _ in range(t)]
    pad = 0
    if padded is not None:
        pad = padded.num_patches - num_patches
        if pad < 0 or pad % unit or len(frames) + (pad > 0) > padded.num_frame_segments:
            raise ValueError(f"{num_patches} patches in {len(frames)} frames do not fit {padded}")
    positions = vision_hw_positions(grid_thw, merge, "cpu")  # [num_patches, 2]
    positions = torch.cat([positions, positions.new_zeros(pad, 2)])
    frame_lens = frames + ([pad] if pad else [])
    if padded is None:
        full = make_segments(frame_lens, device)
    else:  # any frame that fits the budget is shorter than it
        full = make_segments(
            frame_lens,
            device,
            num_segments=padded.num_frame_segments,
            max_seqlen=padded.num_patches,
        )
    if not config.is_windowed:
        return VisionAttentionMetadata(positions.to(device), full, full, None, None, use_varlen)
    window_merged = config.window_size // merge // config.patch_size
    index, window_lens = window_order(grid_thw, merge, window_merged)
    if pad:  # padding groups keep their place at the end, in chunks no longer than a window
        index = torch.cat([index, torch.arange(num_patches // unit, padded.num_patches // unit)])
        longest = window_patches(config)
        window_lens += [min(longest, pad - s) for s in range(0, pad, longest)]
    if padded is None:
        windowed = make_segments(window_lens, device)
    else:
        windowed = make_segments(
            window_lens,
            device,
            num_segments=padded.num_patches // unit,
            max_seqlen=window_patches(config),
        )
    positions = positions.view(-1, unit, 2)[index].view(-1, 2)
    return VisionAttentionMetadata(
        positions.to(device),
        full,
        windowed,
        index.to(device),
        torch.argsort(index).to(device),
        use_varlen,
    )
