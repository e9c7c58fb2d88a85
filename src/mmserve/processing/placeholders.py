"""Item markers in token ids: validation and expansion to one placeholder id per embedding."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mmserve.errors import InvalidRequestError
from mmserve.multimodal import ItemData, MultiModalFeature, PlaceholderRange, RemoteItem
from mmserve.processing.item_resolver import ResolvedItem


@dataclass(frozen=True)
class VisionTokenIds:
    """The model's vision token ids, from config.json (with the tokenizer's strings for them)."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VisionTokenIds:
        text = config.get("text_config") or {}

        def get(name: str) -> int:
            value = config.get(name, text.get(name))
            if value is None:
                raise ValueError(f"config.json has no {name}; is this a Qwen2-VL checkpoint?")
            return int(value)

        return cls(
            get("image_token_id"),
            get("video_token_id"),
            get("vision_start_token_id"),
            get("vision_end_token_id"),
        )


def find_mm_pads(
    input_ids: list[int], expected: Mapping[str, int], pad_ids: Mapping[str, int], t: VisionTokenIds
) -> list[tuple[int, str]]:
    """(position, modality) of every item marker, in prompt order; each must sit as
    <vision_start><pad><vision_end>, and there must be `expected[modality]` of each kind.

    `pad_ids`: every modality the model knows, by name, with its pad token id (a marker of a
    modality that has no items is an error too)."""
    by_id = {tok: name for name, tok in pad_ids.items()}
    pads = [(i, by_id[tok]) for i, tok in enumerate(input_ids) if tok in by_id]
    for name in pad_ids:
        found = sum(1 for _, m in pads if m == name)
        wanted = expected.get(name, 0)
        if found != wanted:
            marker = f"<|vision_start|><|{name}_pad|><|vision_end|>"
            raise InvalidRequestError(
                f"the prompt has {found} {name} marker(s) but {wanted} {name}(s) were "
                f"given; put exactly one {marker} per {name}",
                param="prompt",
            )
    n = len(input_ids)
    for i, name in pads:
        if not (
            i > 0
            and input_ids[i - 1] == t.vision_start_token_id
            and i + 1 < n
            and input_ids[i + 1] == t.vision_end_token_id
        ):
            raise InvalidRequestError(
                f"each <|{name}_pad|> must appear as <|vision_start|><|{name}_pad|><|vision_end|>",
                param="prompt",
            )
    starts = sum(1 for tok in input_ids if tok == t.vision_start_token_id)
    ends = sum(1 for tok in input_ids if tok == t.vision_end_token_id)
    if starts != len(pads) or ends != len(pads):
        raise InvalidRequestError(
            "the prompt has <|vision_start|>/<|vision_end|> tokens that do not wrap an item",
            param="prompt",
        )
    return pads


@dataclass(frozen=True, slots=True)
class PadPiece:
    """One run of placeholder ids in a pad's replacement and the text ids around it: a whole
    item, or one temporal group of a timestamped video (video_groups.py)."""

    item: ResolvedItem
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()


def expand_pads(
    input_ids: Sequence[int],
    pad_positions: Sequence[int],
    replacements: Sequence[Sequence[PadPiece]],
    pad_ids: Mapping[str, int],
) -> tuple[list[int], list[MultiModalFeature], dict[str, ItemData]]:
    """Replace each single pad by its pieces, each piece's item by num_tokens copies; record
    the ranges. Returns the expanded ids, the item specs and each item's data by identifier.

    ids:       ... <vs> <pad> <ve> ...           one pad per item
    expanded:  ... <vs> <pad> x num_tokens <ve>  PlaceholderRange(offset, num_tokens)

    A timestamped video's pad becomes one piece per temporal group, text between them:

    expanded:  ... <vs> [before_k <pad> x n_k after_k for each group k] <ve> ...
    """
    expanded: list[int] = []
    features: list[MultiModalFeature] = []
    data: dict[str, ItemData] = {}
    prev = 0
    for pos, pieces in zip(pad_positions, replacements, strict=True):
        expanded += input_ids[prev:pos]
        for piece in pieces:
            item = piece.item
            expanded += piece.before
            placeholder = PlaceholderRange(offset=len(expanded), length=item.num_tokens)
            expanded += [pad_ids[item.modality]] * item.num_tokens
            expanded += piece.after
            features.append(
                MultiModalFeature(
                    identifier=item.identifier,
                    modality=item.modality,
                    placeholder=placeholder,
                    grid_thw=item.grid_thw,
                    is_remote=isinstance(item.data, RemoteItem),
                )
            )
            data[item.identifier] = item.data
        prev = pos + 1
    expanded += input_ids[prev:]
    return expanded, features, data
