"""Offline prompt inputs: items paired with their uuids, what counts as one video, and the
shapes `multi_modal_uuids` may take."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from PIL import Image

from mmserve.errors import InvalidRequestError
from mmserve.processing.chat import ChatImage, check_media_uuid
from mmserve.processing.video_decode import DecodedVideo


def with_uuids(items: list[Any], uuids: Sequence[Any] | None, modality: str) -> list[tuple]:
    """Pair items with their caller uuids (checked), one entry (or None) per item."""
    uuids = list(uuids) if uuids is not None else [None] * len(items)
    if len(uuids) != len(items):
        raise InvalidRequestError(
            f"multi_modal_uuids has {len(uuids)} {modality} entries but {len(items)} "
            f"{modality}s were given; give one entry (or null) per {modality}",
            param="multi_modal_uuids",
        )
    for i, uuid in enumerate(uuids):
        if uuid is not None:
            check_media_uuid(uuid, f"multi_modal_uuids.{modality}[{i}]", "multi_modal_uuids")
    return list(zip(items, uuids, strict=True))


def is_one_video(value: Any) -> bool:
    """One video (not a list of videos): a path, bytes, a frames array, or a list of frames."""
    if value is None or isinstance(value, str | bytes | bytearray | Path | DecodedVideo):
        return True
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return True
    if isinstance(value, Sequence) and value:
        first = value[0]  # a frame (H x W x 3, or a picture) or a whole video
        return isinstance(first, Image.Image) or getattr(first, "ndim", 0) == 3
    return False


def offline_uuids(value: Any) -> dict[str, list[Any]]:
    """`multi_modal_uuids` of an offline prompt: {"image" | "video": uuid | [uuid | None]}."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or set(value) - {"image", "video"}:
        raise InvalidRequestError(
            'multi_modal_uuids must look like {"image": ["uuid-1", null], "video": ["v-1"]}',
            param="multi_modal_uuids",
        )
    out: dict[str, list[Any]] = {}
    for modality, uuids in value.items():
        if uuids is None:
            continue
        if isinstance(uuids, str):
            out[modality] = [uuids]
        elif isinstance(uuids, Sequence):
            out[modality] = list(uuids)
        else:
            raise InvalidRequestError(
                f'multi_modal_uuids["{modality}"] must be a uuid or a list of uuids (or null)',
                param="multi_modal_uuids",
            )
    return out


class PromptItem(NamedTuple):
    """One image or video of a prompt (loaded, or None for a UUID-only reference) and the
    caller's uuid for it."""

    modality: str
    data: Any
    uuid: str | None


def chat_items(parts: Sequence[ChatImage], loaded: Sequence[Any]) -> list[PromptItem]:
    """A chat's parts with what loading them gave (in the same order) as prompt items."""
    return [PromptItem(p.modality, x, p.uuid) for p, x in zip(parts, loaded, strict=True)]


class GenerateInput(NamedTuple):
    """An offline `LLM.generate` prompt dict, checked, with its items in lists."""

    prompt: str
    images: list[Any]
    videos: list[Any]
    uuids: dict[str, list[Any]]
    mm_processor_kwargs: Mapping[str, Any] | None


def parse_generate_input(prompt: Mapping[str, Any]) -> GenerateInput:
    """{"prompt", "multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids"}: unknown
    keys and modalities refused, one image or video made a list of one."""
    unknown = set(prompt) - {
        "prompt",
        "multi_modal_data",
        "mm_processor_kwargs",
        "multi_modal_uuids",
    }
    if unknown:
        raise InvalidRequestError(f"unsupported prompt keys {sorted(unknown)}")
    mm_data = dict(prompt.get("multi_modal_data") or {})
    images = mm_data.pop("image", [])
    videos = mm_data.pop("video", [])
    if mm_data:
        raise InvalidRequestError(
            f"unsupported modalities {sorted(mm_data)} in multi_modal_data; only 'image' "
            "and 'video'"
        )
    one = images is None or isinstance(images, Image.Image | str | bytes | bytearray)
    return GenerateInput(
        prompt.get("prompt", ""),
        [images] if one else images,
        [videos] if is_one_video(videos) else list(videos),
        offline_uuids(prompt.get("multi_modal_uuids")),
        prompt.get("mm_processor_kwargs"),
    )
