"""A timestamped video (Qwen3-VL) as one item per temporal group, each led by its time as text.

The engine's contract is one contiguous run of placeholder ids per item (PlaceholderRange).
A timestamped video's placeholders are interrupted by text (each group's time and its
<|vision_start|> / <|vision_end|>), so each temporal group is an item of its own:

    video (grid t x h x w, identity V)  ->  t items of grid 1 x h x w,
                                            identity digest(V, k), pixels rows [k*h*w, (k+1)*h*w)

This is exact, not an approximation: Qwen3-VL's vision tower attends within one temporal
patch (its attention segments are frames of the grid), and its position embeddings repeat over
t; the prompt's M-RoPE treats each group as a one-frame grid too (transformers'
get_rope_index splits video_grid_thw into t grids of 1). Qwen2-VL and Qwen2.5-VL videos stay
one item (their groups are not separated by text).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from mmserve.hashing import Hasher
from mmserve.multimodal import EncoderInput
from mmserve.processing.item_resolver import ItemPlan, ResolvedItem
from mmserve.processing.placeholders import PadPiece, VisionTokenIds
from mmserve.processing.video_processor import VideoPlan
from mmserve.processing.video_timestamps import timestamp_text

GROUP_DOMAIN = "mm-video-group/v1"

Stamps = list[tuple[int, ...]]  # each temporal group's timestamp text, as token ids


def plan_stamps(plans: Sequence[ItemPlan], encode: Callable[[str], list[int]]) -> list[Stamps]:
    """Per item: its groups' timestamp ids (a timestamped video), or [] (any other item)."""
    out: list[Stamps] = []
    for plan in plans:
        detail = plan.planned.detail
        times = detail.group_times if isinstance(detail, VideoPlan) else ()
        out.append([tuple(encode(timestamp_text(t))) for t in times])
    return out


def stamp_tokens(stamps: Sequence[Stamps]) -> int:
    """Prompt tokens the groups add besides placeholders: each time, <vs> and <ve>."""
    return sum(len(ids) + 2 for item in stamps for ids in item)


def pad_pieces(
    items: Sequence[ResolvedItem],
    stamps: Sequence[Stamps],
    token_ids: VisionTokenIds,
    hasher: Hasher,
) -> list[list[PadPiece]]:
    """What each item's pad becomes: the item itself, or its timestamped groups."""
    return [
        _group_pieces(item, s, token_ids, hasher) if s else [PadPiece(item)]
        for item, s in zip(items, stamps, strict=True)
    ]


def _group_pieces(
    item: ResolvedItem, stamps: Stamps, token_ids: VisionTokenIds, hasher: Hasher
) -> list[PadPiece]:
    grid_t, grid_h, grid_w = item.grid_thw
    data = item.data
    assert isinstance(data, EncoderInput), type(data)  # videos are processed locally
    assert len(stamps) == grid_t, (len(stamps), item.grid_thw)
    rows = grid_h * grid_w
    group_grid = (1, grid_h, grid_w)
    pieces = []
    for k, ids in enumerate(stamps):
        # a copy: each group owns its buffer. A view would save the copy (~15-50% of this
        # video's CPU stage) but execution's pixel store counts the whole buffer a view keeps
        # alive, once per group (held_bytes), and would evict kept pixels t times too early.
        pixels = np.array(data.pixel_values[k * rows : (k + 1) * rows])  # [h*w, C*T*P*P]
        group = ResolvedItem(
            identifier=hasher.digest(GROUP_DOMAIN, [item.identifier, k]),
            modality=item.modality,
            data=EncoderInput(pixels, group_grid, data.normalization, data.second_per_grid_t),
            grid_thw=group_grid,
            num_tokens=item.num_tokens // grid_t,
        )
        before = (*ids, token_ids.vision_start_token_id)
        pieces.append(PadPiece(group, before, (token_ids.vision_end_token_id,)))
    return pieces
