"""Offline prompt inputs: items paired with their uuids, what counts as one video, and the
shapes `multi_modal_uuids` may take."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from mmserve.errors import InvalidRequestError
from mmserve.processing.chat import check_media_uuid
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
