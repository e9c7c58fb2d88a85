"""Qwen3-VL's video arithmetic: frames sampled, one pixel budget over all frames, and the time
of each temporal patch, which the prompt carries as text.

The reference is transformers' Qwen3VLVideoProcessor (video_processing_qwen3_vl.py) and
Qwen3VLProcessor.replace_video_token:

    nframes  = int(total_frames / video_fps * fps), clamped to [min_frames, max_frames] and
               to total_frames (no rounding to an even count: patchify repeats the last frame)
    indices  = round(linspace(0, total_frames - 1, nframes))
    size     = smart_resize over the whole clip: t_bar * h * w <= longest_edge (total_pixels
               here), >= shortest_edge (min_pixels here), t_bar = nframes rounded to T
    time     = each kept frame's time in seconds; a temporal patch's time is the mean of its
               first and last frame (the last frame repeated to fill the final patch)

Frames given as an array count as sampled at 2 per second (frame i at i / 2 s). A decoded
file's frames carry their own presentation times (`VideoMeta.frame_times`).

In the prompt the video's single <|video_pad|> becomes one group per temporal patch, as
transformers 5 expands it (the template's outer markers stay):

    <|vision_start|> <0.2 seconds><|vision_start|><|video_pad|> x N<|vision_end|>
                     <1.2 seconds><|vision_start|><|video_pad|> x N<|vision_end|> ...
                     <|vision_end|>

Each group is its own item for the engine (video_groups.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mmserve.errors import InvalidRequestError
from mmserve.processing.image_processor import (
    MAX_ASPECT_RATIO,
    ImageProcessorConfig,
    max_tokens_per_item,
)
from mmserve.processing.video_sampling import FPS_MAX_FRAMES, FPS_MIN_FRAMES, VideoConfig

# transformers' Qwen3VLVideoProcessor class defaults, used only where the file does not say.
QWEN3_VIDEO_MIN_PIXELS = 128 * 32 * 32
QWEN3_VIDEO_MAX_PIXELS = 32 * 32 * 768
_QWEN3_PROCESSOR_MARK = "Qwen3VL"
# Keys of a video file that must agree with the image processor's (ours patchify both alike).
_SHARED_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")


def is_timestamped_config(raw: Mapping[str, Any]) -> bool:
    """Whether a (video_)preprocessor_config.json names Qwen3-VL's processors."""
    kinds = (raw.get("video_processor_type"), raw.get("processor_class"))
    return any(_QWEN3_PROCESSOR_MARK in str(k) for k in kinds if k)


def timestamped_config(
    raw: Mapping[str, Any], image_raw: Mapping[str, Any] | None = None
) -> VideoConfig:
    """A Qwen3-VL video_preprocessor_config.json -> VideoConfig (timestamps on).

    `size.longest_edge` is the clip's pixel budget (max_pixels and total_pixels: a request
    may lower either), `size.shortest_edge` its floor (min_pixels). `image_raw`: the
    preprocessor_config.json, whose patch geometry and normalisation the video must share."""
    if raw.get("cap_pixels_per_frame"):
        raise ValueError(
            "video_preprocessor_config.json sets cap_pixels_per_frame, which mmserve does not "
            "implement for Qwen3-VL videos; remove it (transformers' default is off)"
        )
    for key in _SHARED_KEYS:
        if image_raw is not None and key in raw and key in image_raw and raw[key] != image_raw[key]:
            raise ValueError(
                f"video_preprocessor_config.json has {key}={raw[key]!r} but "
                f"preprocessor_config.json has {image_raw[key]!r}; mmserve needs them equal"
            )
    size = raw.get("size") or {}
    total = int(size.get("longest_edge") or QWEN3_VIDEO_MAX_PIXELS)
    kwargs: dict[str, Any] = {
        "min_pixels": int(size.get("shortest_edge") or QWEN3_VIDEO_MIN_PIXELS),
        "max_pixels": total,
        "total_pixels": total,
        "min_frames": int(raw.get("min_frames") or FPS_MIN_FRAMES),
        "max_frames": int(raw.get("max_frames") or FPS_MAX_FRAMES),
        "timestamps": True,
    }
    if raw.get("fps") is not None:
        kwargs["fps"] = float(raw["fps"])
    return VideoConfig(**kwargs)


def num_timestamped_frames(total_frames: int, video_fps: float, cfg: VideoConfig) -> int:
    """How many frames Qwen3VLVideoProcessor.sample_frames keeps from a decoded video: at the
    rate cfg.fps, or a request's num_frames (no more than the video has)."""
    if cfg.num_frames is not None:
        nframes = min(cfg.num_frames, total_frames)
    else:
        nframes = int(total_frames / video_fps * cfg.fps)
        nframes = min(max(nframes, cfg.min_frames), cfg.max_frames, total_frames)
    if nframes < 2:
        raise InvalidRequestError(
            f"the video has {total_frames} frame(s); at least 2 are needed (send a single "
            "picture as an image)",
            param="video_url",
        )
    return nframes


def clip_smart_resize(
    num_frames: int,
    height: int,
    width: int,
    *,
    factor: int,
    temporal_factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """The frame size (height, width) of a clip: transformers' Qwen3-VL video smart_resize, its
    pixel limits over all frames (t_bar x h x w)."""
    if num_frames < temporal_factor:
        raise InvalidRequestError(
            f"the video has {num_frames} frame(s); at least {temporal_factor} are needed",
            param="video_url",
        )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidRequestError(
            f"video aspect ratio {max(height, width) / min(height, width):.1f} is over the "
            f"limit of {MAX_ASPECT_RATIO}; crop or pad the video",
            param="video_url",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def clip_max_pixels(cfg: VideoConfig) -> int:
    """The clip's pixel budget: total_pixels, or a request's (or the server's) lower max_pixels
    (with timestamps, min_pixels and max_pixels are over the whole clip, as transformers'
    `size` is for Qwen3-VL videos; a request's `size` or min/max_pixels reach it)."""
    return min(cfg.total_pixels, cfg.max_pixels)


def sample_times(
    indices: Sequence[int], video_fps: float, known: Mapping[int, float] | None = None
) -> list[float]:
    """Seconds of each kept frame: its decoded time where `known`, else index / fps."""
    known = known or {}
    return [known.get(i, i / video_fps) for i in indices]


def group_times(frame_times: Sequence[float], temporal_patch_size: int) -> tuple[float, ...]:
    """The time of each temporal patch: the mean of its first and last frame (transformers'
    _calculate_timestamps; the last frame repeats to fill the final patch)."""
    times = list(frame_times)
    if pad := -len(times) % temporal_patch_size:
        times += [times[-1]] * pad
    t = temporal_patch_size
    return tuple((times[i] + times[i + t - 1]) / 2 for i in range(0, len(times), t))


def timestamp_text(seconds: float) -> str:
    """The text in front of a temporal patch, exactly as Qwen3VLProcessor writes it."""
    return f"<{seconds:.1f} seconds>"


def max_tokens_per_group(cfg: VideoConfig, image_cfg: ImageProcessorConfig) -> int:
    """An upper bound on one temporal patch's tokens under cfg (requests only lower it).

    At least two frames share the budget (t_bar >= 2), so a frame is at most half of it (or
    one factor wide on a clamped side, as for images); the floor's ceilings add at most one
    factor per side. The image bound's cases cover these with those limits."""
    frame_max = max(1, clip_max_pixels(cfg) // 2)
    frame_min = min(max(1, math.ceil(cfg.min_pixels / 2)), frame_max)
    frame_cfg = ImageProcessorConfig(
        min_pixels=frame_min,
        max_pixels=frame_max,
        patch_size=image_cfg.patch_size,
        merge_size=image_cfg.merge_size,
    )
    return max_tokens_per_item(frame_cfg)


def linspace_indices(total_frames: int, nframes: int) -> tuple[int, ...]:
    """round(linspace(0, total - 1, n)), as transformers' sample_frames (numpy rounding)."""
    return tuple(int(i) for i in np.linspace(0, total_frames - 1, nframes).round().astype(int))
