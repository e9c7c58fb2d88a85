"""Modalities as processors registered by name: plan (grid, tokens), content key, process.

Nothing else on the CPU path names a modality: the item resolver, the placeholder splice and
the limits look a modality up here by its name ("image", "video") and call these four:

    record(item)           what a UUID-only reference keeps to plan the item again
    plan(record, cfg)      grid, placeholder tokens and the decision identity covers
    content_key(item, ns)  what identity covers of the item's content
    process(item, plan)    the encoder input (patches), on a processor-cache miss
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Protocol

from PIL import Image

from mmserve.grid import grid_num_tokens
from mmserve.hashing import ITEM_DOMAIN, ContentKey, claimed_content_key, pixel_content_key
from mmserve.multimodal import EncoderInput, RemoteItem
from mmserve.processing.image_processor import ImageProcessorConfig, get_grid_thw, process_image
from mmserve.processing.processor_cache import UUIDRecord
from mmserve.processing.video_decode import DecodedVideo
from mmserve.processing.video_processor import VideoMeta, VideoPlan, plan_video, process_video
from mmserve.processing.video_sampling import VideoConfig

EXIF_IMAGE_UNIQUE_ID = 0xA420
EXIF_SUB_IFD = 0x8769


@dataclass(frozen=True)
class ProcessingConfig:
    """One request's processing configuration, every modality's part (kwargs applied)."""

    image: ImageProcessorConfig
    video: VideoConfig = field(default_factory=VideoConfig)


@dataclass(frozen=True, slots=True)
class Planned:
    grid_thw: tuple[int, int, int]
    num_tokens: int
    decision: tuple[int, ...]  # what processing does, for identity
    detail: VideoPlan | None = None  # a modality's own plan, for `process`
    domain: str = ITEM_DOMAIN  # the identity's hash domain


class Modality(Protocol):
    name: str
    placeholder_token: str  # the chat template's marker, one per item before expansion
    record_type: type | tuple[type, ...]  # what `record` returns

    def record(self, item: Any) -> object: ...

    def plan(self, record: object, cfg: ProcessingConfig) -> Planned: ...

    def fingerprint(self, cfg: ProcessingConfig) -> tuple[str | int, ...]: ...

    def content_key(self, item: Any, namespace: str) -> ContentKey: ...

    def process(
        self, item: Any, planned: Planned, cfg: ProcessingConfig
    ) -> EncoderInput | RemoteItem: ...


def exif_image_id(image: Image.Image) -> str | None:
    """The EXIF ImageUniqueID (tag 0xA420) of an image, if it carries a non-empty one."""
    try:
        exif = image.getexif()
        value = exif.get(EXIF_IMAGE_UNIQUE_ID) or exif.get_ifd(EXIF_SUB_IFD).get(
            EXIF_IMAGE_UNIQUE_ID
        )
    except Exception:  # noqa: BLE001 - a malformed EXIF block just means "no claimed id"
        return None
    if isinstance(value, bytes):
        value = value.decode("ascii", errors="replace")
    if isinstance(value, str) and value.strip("\x00 "):
        return value.strip("\x00 ")
    return None


@dataclass(frozen=True)
class ImageModality:
    """A decoded RGB image. `trust_exif_image_id`: see ItemResolver."""

    trust_exif_image_id: bool = False
    name: str = "image"
    placeholder_token: str = "<|image_pad|>"
    record_type = UUIDRecord

    def record(self, item: Image.Image) -> UUIDRecord:
        return UUIDRecord(width=item.width, height=item.height, mode=item.mode)

    def plan(self, record: object, cfg: ProcessingConfig) -> Planned:
        assert isinstance(record, UUIDRecord)
        t, h, w = get_grid_thw(record.width, record.height, cfg.image)
        num_tokens = grid_num_tokens((t, h, w), cfg.image.merge_size)
        patch = cfg.image.patch_size
        return Planned((t, h, w), num_tokens, (h * patch, w * patch, t, h, w))

    def fingerprint(self, cfg: ProcessingConfig) -> tuple[str | int, ...]:
        return cfg.image.fingerprint()

    def content_key(self, item: Image.Image, namespace: str) -> ContentKey:
        exif_id = exif_image_id(item) if self.trust_exif_image_id else None
        if exif_id is not None:
            return claimed_content_key("exif", namespace, exif_id)
        palette = item.getpalette() if item.mode == "P" else None
        return pixel_content_key(
            item.mode, item.size, item.tobytes(), bytes(palette) if palette else None
        )

    def process(self, item: Image.Image, planned: Planned, cfg: ProcessingConfig) -> EncoderInput:
        return process_image(item, cfg.image)


@dataclass(frozen=True)
class VideoModality:
    """A video: decoded sampled frames (`DecodedVideo`), from a container or given as frames."""

    name: str = "video"
    placeholder_token: str = "<|video_pad|>"
    record_type = VideoMeta

    def record(self, item: DecodedVideo) -> VideoMeta:
        return item.meta

    def plan(self, record: object, cfg: ProcessingConfig) -> Planned:
        assert isinstance(record, VideoMeta)
        vp = plan_video(record, cfg.video, cfg.image)
        h, w = vp.resized_hw
        # Identity by effect: the frames kept, their size, the grid and the time per temporal
        # patch (M-RoPE), not the raw fps / num_frames / max_frames that chose them; with
        # timestamps, each temporal patch's time (ms), which is prompt text.
        seconds = struct.unpack("<q", struct.pack("<d", vp.second_per_grid_t))[0]
        times = tuple(round(s * 1000) for s in vp.group_times)
        decision = (vp.num_frames, *vp.frame_indices, h, w, *vp.grid_thw, seconds, *times)
        return Planned(vp.grid_thw, vp.num_tokens, decision, vp)

    def fingerprint(self, cfg: ProcessingConfig) -> tuple[str | int, ...]:
        return cfg.image.fingerprint()  # the sampling values act through the decision

    def content_key(self, item: DecodedVideo, namespace: str) -> ContentKey:
        meta = item.meta
        if meta.is_sampled:
            return ("frames", meta.total_frames, meta.width, meta.height, item.content)
        return ("video-bytes", item.content)

    def process(self, item: DecodedVideo, planned: Planned, cfg: ProcessingConfig) -> EncoderInput:
        assert planned.detail is not None
        return process_video(item.frames, planned.detail, cfg.image)


def default_modalities(*, trust_exif_image_id: bool = False) -> dict[str, Modality]:
    """The modalities a Qwen2-VL checkpoint reads, by name."""
    return {"image": ImageModality(trust_exif_image_id), "video": VideoModality()}
