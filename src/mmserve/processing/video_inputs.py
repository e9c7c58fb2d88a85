"""What a video may arrive as, and the engine-wide video settings and bounds.

Offline (`LLM.generate` multi_modal_data, `LLM.chat` video parts): a file path, bytes, a URL,
or frames (a [T, H, W, 3] uint8 array, a list of H x W x 3 uint8 arrays or PIL images),
frames counting as already sampled at 2 per second (or at a request's fps). Over HTTP:
`video_url` parts only, sampled per request by mm_processor_kwargs or media_io_kwargs.video.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmserve.config.media import DEFAULT_MAX_VIDEO_FPS, VideoLimits
from mmserve.errors import InvalidRequestError, VideoTooLargeError
from mmserve.multimodal import EncoderInput
from mmserve.processing.decode_budget import RequestDecodeBudget
from mmserve.processing.image_processor import (
    OVERRIDABLE_KEYS,
    ImageProcessorConfig,
    max_tokens_per_item,
)
from mmserve.processing.media import MediaLoader
from mmserve.processing.modalities import ProcessingConfig
from mmserve.processing.video_decode import DecodedVideo
from mmserve.processing.video_processor import VideoMeta
from mmserve.processing.video_sampling import FPS, VIDEO_KEYS, VideoConfig, frame_max_pixels
from mmserve.processing.video_timestamps import (
    is_timestamped_config,
    max_tokens_per_group,
    timestamped_config,
)

# Videos per prompt when --limit-mm-per-prompt does not name "video" (vLLM V1 allows 999 of
# every modality): each video may cost up to the decode ceilings, so one unless raised.
DEFAULT_VIDEO_LIMIT = 1
VIDEO_CONFIG_FILE = "video_preprocessor_config.json"


def split_processor_kwargs(
    kwargs: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """mm_processor_kwargs -> (the image processor's keys, the video processor's keys).

    min_pixels / max_pixels go to both, and so does `size` (transformers' spelling of the two:
    shortest_edge / longest_edge, in pixels per image or frame); fps, num_frames, max_frames,
    total_pixels to videos only."""
    if not kwargs:
        return {}, {}
    if not isinstance(kwargs, Mapping):
        raise InvalidRequestError(
            'mm_processor_kwargs must be an object such as {"max_pixels": 1003520}',
            param="mm_processor_kwargs",
        )
    known = (*OVERRIDABLE_KEYS, *VIDEO_KEYS, "size")
    unknown = sorted(str(k) for k in kwargs if k not in known)
    if unknown:
        raise InvalidRequestError(
            f"mm_processor_kwargs: unsupported key(s) {unknown}; only "
            f"{sorted(set(known))} can be set per request",
            param="mm_processor_kwargs",
        )
    kwargs = _size_as_pixels(kwargs)
    image = {k: v for k, v in kwargs.items() if k in OVERRIDABLE_KEYS}
    video = {k: v for k, v in kwargs.items() if k in VIDEO_KEYS}
    return image, video


_SIZE_KEYS = {"shortest_edge": "min_pixels", "longest_edge": "max_pixels"}


def _size_as_pixels(kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    """`size: {"shortest_edge": a, "longest_edge": b}` -> min_pixels a, max_pixels b."""
    size = kwargs.get("size")
    if size is None:
        return kwargs
    if not isinstance(size, Mapping) or not size or set(size) - set(_SIZE_KEYS):
        raise InvalidRequestError(
            'mm_processor_kwargs.size must be an object with "shortest_edge" and/or '
            '"longest_edge" (pixels per image or video frame)',
            param="mm_processor_kwargs.size",
        )
    out = {k: v for k, v in kwargs.items() if k != "size"}
    for edge, key in _SIZE_KEYS.items():
        if edge not in size:
            continue
        value = size[edge]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidRequestError(
                f"mm_processor_kwargs.size.{edge} must be a positive integer, got {value!r}",
                param=f"mm_processor_kwargs.size.{edge}",
            )
        if key in out and out[key] != value:
            raise InvalidRequestError(
                f"mm_processor_kwargs.size.{edge} ({value}) and mm_processor_kwargs.{key} "
                f"({out[key]!r}) disagree; send one of them",
                param=f"mm_processor_kwargs.size.{edge}",
            )
        out[key] = value
    return out


# vLLM's per-request media loading arguments that mmserve honours (media_io_kwargs.video).
MEDIA_IO_VIDEO_KEYS = ("fps", "num_frames")


def video_request_kwargs(
    video_kwargs: Mapping[str, Any], media_io_kwargs: Any
) -> tuple[dict[str, Any], dict[str, str]]:
    """A request's video keys from mm_processor_kwargs and vLLM's `media_io_kwargs: {"video":
    {"fps", "num_frames"}}` together, and each key's field for errors. The same key in both
    with different values is refused; anything else in media_io_kwargs is refused by name."""
    merged, params = dict(video_kwargs), {}
    if media_io_kwargs is None:
        return merged, params
    if not isinstance(media_io_kwargs, Mapping):
        raise InvalidRequestError(
            'media_io_kwargs must be an object such as {"video": {"fps": 4}}',
            param="media_io_kwargs",
        )
    for modality in media_io_kwargs:
        if modality != "video":
            raise InvalidRequestError(
                f"media_io_kwargs.{str(modality)[:40]} is not supported by this server; only "
                f"media_io_kwargs.video ({', '.join(MEDIA_IO_VIDEO_KEYS)}) is",
                param=f"media_io_kwargs.{str(modality)[:40]}",
            )
    video = media_io_kwargs.get("video")
    if video is None:
        return merged, params
    if not isinstance(video, Mapping):
        raise InvalidRequestError(
            'media_io_kwargs.video must be an object such as {"fps": 4}',
            param="media_io_kwargs.video",
        )
    for key, value in video.items():
        param = f"media_io_kwargs.video.{str(key)[:40]}"
        if key not in MEDIA_IO_VIDEO_KEYS:
            raise InvalidRequestError(
                f"{param} is not supported by this server; only "
                f"{', '.join(MEDIA_IO_VIDEO_KEYS)} can be set there",
                param=param,
            )
        if key in merged and merged[key] != value:
            raise InvalidRequestError(
                f"{param} ({value!r}) and mm_processor_kwargs.{key} ({merged[key]!r}) "
                "disagree; send one of them",
                param=param,
            )
        merged[key], params[key] = value, param
    return merged, params


def load_video_config(
    model_dir: str | Path,
    server_kwargs: Mapping[str, Any] | None,
    max_fps: float = DEFAULT_MAX_VIDEO_FPS,
) -> VideoConfig:
    """The checkpoint's video_preprocessor_config.json (else qwen-vl-utils' defaults), with
    --mm-processor-kwargs' video keys over it and --max-video-fps as the requests' ceiling.
    A Qwen3-VL processor's files (by the processor types they name) are read as Qwen3-VL's
    (video_timestamps.py)."""
    path = Path(model_dir) / VIDEO_CONFIG_FILE
    raw = json.loads(path.read_text()) if path.is_file() else {}
    image_path = Path(model_dir) / "preprocessor_config.json"
    image_raw = json.loads(image_path.read_text()) if image_path.is_file() else {}
    if is_timestamped_config(raw) or (not raw and is_timestamped_config(image_raw)):
        cfg = timestamped_config(raw, image_raw)
    else:
        cfg = VideoConfig.from_dict(raw)
    return cfg.with_server_overrides(split_processor_kwargs(server_kwargs)[1], max_fps)


def max_tokens_per_video(cfg: VideoConfig, image_cfg: ImageProcessorConfig) -> int:
    """An upper bound on the placeholder tokens of any one video a request may send.

    Requests stay within these values' frame and pixel ceilings (VideoConfig.for_request),
    and every frame count from one to max_frames is tried: the per-frame cap falls as frames
    share the total budget."""
    return max(
        _tokens_per_patch(n, cfg, image_cfg) * math.ceil(n / image_cfg.temporal_patch_size)
        for n in range(1, cfg.max_frames + 1)
    )


def accepts_video(limit_mm_per_prompt: Mapping[str, int] | None) -> bool:
    """Whether a server with this --limit-mm-per-prompt takes videos (one unless it says)."""
    return {"video": DEFAULT_VIDEO_LIMIT, **(limit_mm_per_prompt or {})}["video"] > 0


def largest_item_tokens(
    image_cfg: ImageProcessorConfig,
    video_cfg: VideoConfig,
    limit_mm_per_prompt: Mapping[str, int] | None,
    max_model_len: int,
) -> int:
    """Placeholder tokens of the largest item any request may send: an image, or a video
    when videos are accepted (no item over max_model_len can ever run, so that bounds it).
    Input patches are merge_size**2 per token for every modality."""
    tokens = max_tokens_per_item(image_cfg)
    if accepts_video(limit_mm_per_prompt):
        # a timestamped video's items are its temporal groups (video_groups.py)
        per_video = (
            max_tokens_per_group(video_cfg, image_cfg)
            if video_cfg.timestamps
            else max_tokens_per_video(video_cfg, image_cfg)
        )
        tokens = max(tokens, min(per_video, max_model_len))
    return tokens


def _tokens_per_patch(nframes: int, cfg: VideoConfig, image_cfg: ImageProcessorConfig) -> int:
    cap = frame_max_pixels(nframes, cfg)
    frame_cfg = ImageProcessorConfig(
        min_pixels=min(cfg.min_pixels, cap),
        max_pixels=cap,
        patch_size=image_cfg.patch_size,
        merge_size=image_cfg.merge_size,
    )
    return max_tokens_per_item(frame_cfg)


def video_from_frames(frames: Any, cfg: VideoConfig, limits: VideoLimits) -> DecodedVideo:
    """Frames given by the caller (already sampled) -> a DecodedVideo, checked."""
    if isinstance(frames, np.ndarray):
        count = frames.shape[0] if frames.ndim == 4 else 0
    else:
        count = len(frames)
    if count > cfg.max_frames:
        raise InvalidRequestError(
            f"the video has {count} frames, over the limit of {cfg.max_frames} (max_frames); "
            "send fewer frames",
            param="multi_modal_data",
        )
    if not isinstance(frames, np.ndarray):
        frames = np.stack([_frame_array(f) for f in frames]) if count else np.empty((0,))
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3 or count == 0:
        raise InvalidRequestError(
            "video frames must be a non-empty [T, H, W, 3] uint8 array, or a list of H x W x 3 "
            f"uint8 arrays or PIL images; got shape {frames.shape}, dtype {frames.dtype}",
            param="multi_modal_data",
        )
    _, height, width, _ = frames.shape
    if width * height > limits.max_video_frame_pixels:
        raise VideoTooLargeError(
            f"the video's frames are {width}x{height} pixels, over the limit of "
            f"{limits.max_video_frame_pixels} (--max-video-frame-pixels); downscale them",
            param="multi_modal_data",
        )
    frames = np.ascontiguousarray(frames)
    meta = VideoMeta(width, height, count, FPS, is_sampled=True)
    return DecodedVideo(frames, meta, memoryview(frames).cast("B"))


def _frame_array(frame: Any) -> np.ndarray:
    if isinstance(frame, Image.Image):
        return np.asarray(frame.convert("RGB"))
    if isinstance(frame, np.ndarray):
        return frame
    raise InvalidRequestError(
        f"a video frame must be a uint8 array or a PIL image, got {type(frame).__name__}",
        param="multi_modal_data",
    )


def offline_video(
    source: Any,
    loader: MediaLoader,
    cfg: ProcessingConfig,
    budget: RequestDecodeBudget,
    *,
    trusted_paths: bool = True,
) -> DecodedVideo | None:
    """Any offline video source -> its decoded frames. `trusted_paths`: a plain file path is
    read as given (the offline caller's own files); URLs follow the server's URL policy."""
    if source is None or isinstance(source, DecodedVideo):
        return source
    if isinstance(source, PathLike) or (
        trusted_paths and isinstance(source, str) and ":" not in source.split("/", 1)[0]
    ):
        source = _read_path(Path(source), loader.config.max_video_bytes)
    if isinstance(source, str | bytes | bytearray | memoryview):
        return loader.load_video(source, cfg.video, cfg.image, budget)
    return video_from_frames(source, cfg.video, loader.config.video_limits)


def _read_path(path: Path, max_bytes: int) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError:
        raise InvalidRequestError(
            f"the video file {str(path)[:200]!r} could not be read", param="multi_modal_data"
        ) from None
    if len(data) > max_bytes:
        raise VideoTooLargeError(
            f"the video file is larger than the {max_bytes}-byte limit (--max-video-bytes)",
            param="multi_modal_data",
        )
    return data


def seconds_per_grid_t(data: object) -> float:
    """A video item's seconds per temporal patch (1.0 where the item does not say)."""
    return (data.second_per_grid_t or 1.0) if isinstance(data, EncoderInput) else 1.0
