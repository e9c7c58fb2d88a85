"""Image markers in token ids: validation and expansion to one placeholder id per embedding."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mmserve.errors import InvalidRequestError
from mmserve.multimodal import MultiModalFeature, PlaceholderRange
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


def find_image_pads(input_ids: list[int], num_images: int, t: VisionTokenIds) -> list[int]:
    """Positions of the image pads; each must sit as <vision_start><image_pad><vision_end>."""
    if t.video_token_id in input_ids:
        raise InvalidRequestError("video input is not supported yet", param="prompt")
    pads = [i for i, tok in enumerate(input_ids) if tok == t.image_token_id]
    if len(pads) != num_images:
        raise InvalidRequestError(
            f"the prompt has {len(pads)} image marker(s) but {num_images} image(s) were "
            "given; put exactly one <|vision_start|><|image_pad|><|vision_end|> per image",
            param="prompt",
        )
    n = len(input_ids)
    for i in pads:
        if not (
            i > 0
            and input_ids[i - 1] == t.vision_start_token_id
            and i + 1 < n
            and input_ids[i + 1] == t.vision_end_token_id
        ):
            raise InvalidRequestError(
                "each <|image_pad|> must appear as <|vision_start|><|image_pad|><|vision_end|>",
                param="prompt",
            )
    starts = sum(1 for tok in input_ids if tok == t.vision_start_token_id)
    ends = sum(1 for tok in input_ids if tok == t.vision_end_token_id)
    if starts != num_images or ends != num_images:
        raise InvalidRequestError(
            "the prompt has <|vision_start|>/<|vision_end|> tokens that do not wrap an image",
            param="prompt",
        )
    return pads


def expand_image_pads(
    input_ids: Sequence[int],
    pad_positions: Sequence[int],
    items: Sequence[ResolvedItem],
    image_token_id: int,
) -> tuple[list[int], list[MultiModalFeature]]:
    """Replace each single <|image_pad|> by its item's num_tokens copies; record the ranges.

    ids:       ... <vs> <pad> <ve> ...           one pad per image
    expanded:  ... <vs> <pad> x num_tokens <ve>  PlaceholderRange(offset, num_tokens)
    """
    expanded: list[int] = []
    features: list[MultiModalFeature] = []
    prev = 0
    for pos, item in zip(pad_positions, items, strict=True):
        expanded += input_ids[prev:pos]
        placeholder = PlaceholderRange(offset=len(expanded), length=item.num_tokens)
        expanded += [image_token_id] * item.num_tokens
        features.append(
            MultiModalFeature(
                identifier=item.identity,
                modality="image",
                placeholder=placeholder,
                data=item.data,
                grid_thw=item.grid_thw,
            )
        )
        prev = pos + 1
    expanded += input_ids[prev:]
    return expanded, features
