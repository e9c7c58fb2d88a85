"""M-RoPE position ids of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL prompt (numpy only, no torch).

Qwen3-VL needs nothing of its own here: its video's temporal groups are separate items of
grid (1, h, w) with text between them (video_groups.py), which is exactly how its
get_rope_index splits a video grid; the rotary layer interleaves the three axes.

Every token gets three positions (temporal, height, width). Text tokens use the same value on
all three axes and count up by one. An image or video item of grid (t, h, w) patches is
`t * h/m * w/m` placeholder tokens (m = spatial_merge_size) laid out frame by frame, row by
row; placeholder (ti, hi, wi) gets

    temporal = start + ti * time_interval      height = start + hi      width = start + wi

where `start` is the position the item begins at and `time_interval` is 1, except for
Qwen2.5-VL videos where it is `tokens_per_second * second_per_grid` (truncated to an integer
after the multiplication). The text after an item resumes at one past the largest position
the item used, on any axis.

    tokens:     text text | image 2x3 merged grid        | text
    temporal:    0    1   | 2 2 2 2 2 2                  | 5
    height:      0    1   | 2 2 2 3 3 3                  | 5
    width:       0    1   | 2 3 4 2 3 4                  | 5

Generated tokens: the prompt of n tokens ends at position max(positions) = n - 1 + delta with
`delta = max(positions) + 1 - n` (<= 0 for images). The token at sequence index i >= n has
position `i + delta` on all three axes (`decode_positions`).

NOTE: transformers 5.23 resumes text after an item at `start + max(h, w) / m`, ignoring the
temporal axis. For images (t = 1) and for videos whose temporal span is below their spatial
span that is the same; for long videos we follow the original Qwen implementation (and vLLM)
and resume after the largest position on any axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from mmserve.errors import InvalidRequestError
from mmserve.grid import grid_num_tokens


class MRopePositions(NamedTuple):
    positions: np.ndarray  # [3, num_tokens] int64
    delta: int  # position of generated token i is i + delta on every axis


def _item_positions(
    grid_thw: tuple[int, int, int], merge: int, start: int, time_interval: float
) -> np.ndarray:
    """[3, t * h/m * w/m] positions of one item beginning at `start`."""
    t, h, w = grid_thw
    lh, lw = h // merge, w // merge
    # float32 like the reference implementation, so the truncation agrees bit for bit
    temporal = (np.arange(t, dtype=np.float32) * np.float32(time_interval)).astype(np.int64)
    tt = np.broadcast_to(temporal[:, None, None], (t, lh, lw))
    hh = np.broadcast_to(np.arange(lh)[None, :, None], (t, lh, lw))
    ww = np.broadcast_to(np.arange(lw)[None, None, :], (t, lh, lw))
    return np.stack([tt, hh, ww]).reshape(3, -1).astype(np.int64) + start


def get_mrope_positions(
    input_ids: Sequence[int],
    image_grid_thw: Sequence[tuple[int, int, int]] = (),
    *,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
    video_grid_thw: Sequence[tuple[int, int, int]] = (),
    second_per_grid_ts: Sequence[float] = (),
    tokens_per_second: float | None = None,
) -> MRopePositions:
    """M-RoPE positions [3, len(input_ids)] and the decode delta of a whole prompt.

    `input_ids` carries every item's placeholders already expanded (t*h*w/m^2 ids of
    `image_token_id` or `video_token_id` per item); items consume `image_grid_thw` /
    `video_grid_thw` in order. `tokens_per_second` (Qwen2.5-VL) turns on temporal spacing for
    videos, with `second_per_grid_ts` per video (default 1.0). A placeholder count that does not
    match the grids raises InvalidRequestError.
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    grids = {image_token_id: list(image_grid_thw), video_token_id: list(video_grid_thw)}
    used = {image_token_id: 0, video_token_id: 0}
    chunks: list[np.ndarray] = []
    next_pos = 0
    i, n = 0, len(ids)
    while i < n:
        token = int(ids[i])
        if token not in grids:
            j = i
            while j < n and int(ids[j]) not in grids:
                j += 1
            chunks.append(np.broadcast_to(np.arange(next_pos, next_pos + j - i), (3, j - i)))
            next_pos += j - i
            i = j
            continue
        kind = "image" if token == image_token_id else "video"
        item_idx = used[token]
        if item_idx >= len(grids[token]):
            raise InvalidRequestError(
                f"the prompt has more {kind} placeholders than {kind} grids "
                f"({len(grids[token])} given)"
            )
        grid = tuple(int(v) for v in grids[token][item_idx])
        length = grid_num_tokens(grid, spatial_merge_size)
        if not np.all(ids[i : i + length] == token):
            raise InvalidRequestError(
                f"{kind} {item_idx} with grid {grid} needs {length} consecutive placeholder "
                f"tokens at index {i}, the prompt has fewer"
            )
        interval = 1.0
        if token == video_token_id and tokens_per_second is not None:
            seconds = second_per_grid_ts[item_idx] if item_idx < len(second_per_grid_ts) else 1.0
            interval = float(np.float32(tokens_per_second) * np.float32(seconds))
        item = _item_positions(grid, spatial_merge_size, next_pos, interval)  # type: ignore[arg-type]
        chunks.append(item)
        next_pos = int(item.max()) + 1
        used[token] += 1
        i += length
    for token, kind in ((image_token_id, "image"), (video_token_id, "video")):
        if used[token] != len(grids[token]):
            raise InvalidRequestError(
                f"{len(grids[token])} {kind} grids given but the prompt has placeholders "
                f"for {used[token]}"
            )
    positions = np.concatenate(chunks, axis=1) if chunks else np.zeros((3, 0), np.int64)
    return MRopePositions(positions.astype(np.int64), next_pos - n)


def decode_positions(start: int, num_tokens: int, delta: int) -> np.ndarray:
    """Positions [3, num_tokens] of the tokens at sequence indices start .. start+num_tokens-1,
    all past the prompt: index i gets i + delta on every axis."""
    row = np.arange(start, start + num_tokens, dtype=np.int64) + delta
    return np.broadcast_to(row, (3, num_tokens)).copy()
