"""Qwen2-VL's video arithmetic (qwen-vl-utils' rules): frames sampled, frame size, time per patch.

The numbers are qwen-vl-utils' (vision_process.py), the reference the Qwen2-VL and Qwen2.5-VL
checkpoints were trained and evaluated with; transformers' Qwen2VLVideoProcessor has the same
defaults (its `size`, `fps`, `min_frames`, `max_frames`, `max_video_tokens`).

    nframes  = total_frames / video_fps * fps          frames at `fps` per second of video
             = clamp(nframes, min_frames, min(max_frames, total_frames))
             = floor to a multiple of FRAME_FACTOR     (two frames fold into one temporal patch)
    indices  = round(linspace(0, total_frames - 1, nframes))
    per-frame max pixels = max(min(max_pixels, total_pixels * FRAME_FACTOR // nframes),
                               int(min_pixels * 1.05))
    second_per_grid_t = temporal_patch_size / sample_fps,  sample_fps = nframes / total * video_fps

Frames given as an array are taken as already sampled at FPS (2 per second, so one temporal
patch is one second), as vLLM and qwen-vl-utils assume; an odd count is padded with its last
frame (what transformers' patchify does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mmserve.errors import InvalidRequestError

FRAME_FACTOR = 2  # temporal_patch_size: sampled frame counts are multiples of it
FPS = 2.0  # default sampling rate, frames per second of video
FPS_MIN_FRAMES = 4  # fewest frames sampled from a video (when it has that many)
FPS_MAX_FRAMES = 768  # most frames sampled from one video
VIDEO_MIN_PIXELS = 128 * 28 * 28  # per-frame floor: 128 merged tokens per temporal patch
VIDEO_MAX_PIXELS = 768 * 28 * 28  # per-frame cap: 768 merged tokens per temporal patch
# The whole video's pixel budget: 90% of a 128K-token context's worth of 28x28 patches.
VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)
# A frame's cap never goes below 5% over the floor, however many frames share the budget.
MIN_PIXELS_HEADROOM = 1.05
# A bound on a request's `fps`, so no arithmetic meets an absurd value; the frames sampled
# are bounded by max_frames whatever the rate.
MAX_REQUEST_FPS = 240.0
VIDEO_KEYS = ("fps", "max_frames", "min_pixels", "max_pixels", "total_pixels")


@dataclass(frozen=True)
class VideoConfig:
    """How a video becomes frames: the engine's values, each also a ceiling for requests."""

    fps: float = FPS
    # Qwen3-VL's rules (video_timestamps.py): frames sampled as its video processor does, the
    # pixel limits over the whole clip, each temporal patch a group led by its time as text.
    timestamps: bool = False
    min_frames: int = FPS_MIN_FRAMES
    max_frames: int = FPS_MAX_FRAMES
    min_pixels: int = VIDEO_MIN_PIXELS
    max_pixels: int = VIDEO_MAX_PIXELS
    total_pixels: int = VIDEO_TOTAL_PIXELS

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fps) and 0 < self.fps <= MAX_REQUEST_FPS):
            raise ValueError(f"video fps must be in (0, {MAX_REQUEST_FPS}], got {self.fps}")
        for name in ("min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"video {name} must be a positive integer, got {value!r}")
        if self.max_frames < FRAME_FACTOR or self.min_frames > self.max_frames:
            raise ValueError(
                f"video max_frames ({self.max_frames}) must be >= {FRAME_FACTOR} and >= "
                f"min_frames ({self.min_frames})"
            )
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"video min_pixels ({self.min_pixels}) must not exceed max_pixels "
                f"({self.max_pixels})"
            )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> VideoConfig:
        """From a video_preprocessor_config.json (transformers' names) or server overrides."""
        size = raw.get("size") or {}
        kwargs: dict[str, Any] = {}
        min_pixels = raw.get("min_pixels") or size.get("shortest_edge")
        max_pixels = raw.get("max_pixels") or size.get("longest_edge")
        if min_pixels is not None:
            kwargs["min_pixels"] = int(min_pixels)
        if max_pixels is not None:
            kwargs["max_pixels"] = int(max_pixels)
        for name in ("min_frames", "max_frames", "total_pixels"):
            if raw.get(name) is not None:
                kwargs[name] = int(raw[name])
        if raw.get("fps") is not None:
            kwargs["fps"] = float(raw["fps"])
        return cls(**kwargs)

    def with_server_overrides(self, overrides: Mapping[str, Any] | None) -> VideoConfig:
        """`--mm-processor-kwargs`: its video keys (fps, max_frames, total_pixels) set the
        engine's values. min_pixels / max_pixels there are shared with the image processor
        (as a Hugging Face processor's top-level kwargs are): for videos they can only lower
        the per-frame bounds, so capping images never lets a frame grow past its video
        default (768 x 28 x 28 pixels)."""
        overrides = overrides or {}
        picked = {k: v for k, v in overrides.items() if k in ("fps", "max_frames")}
        if overrides.get("total_pixels") is not None:
            picked["total_pixels"] = overrides["total_pixels"]
        for key in ("min_pixels", "max_pixels"):
            value = overrides.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                picked[key] = min(value, getattr(self, key))
        if "max_pixels" in picked:
            picked["min_pixels"] = min(
                picked.get("min_pixels", self.min_pixels), picked["max_pixels"]
            )
        try:
            return replace(self, **picked) if picked else self
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--mm-processor-kwargs: {exc}") from None

    def for_request(self, kwargs: Mapping[str, Any] | None) -> VideoConfig:
        """A request's mm_processor_kwargs applied: they may only lower the engine's values.

        fps, max_frames and total_pixels are the video's own: a value above the engine's is
        refused (400 naming the key), never taken (CVE-2026-34755: a request that raises the
        frame cap). min_pixels and max_pixels are shared with images (where a request may set
        them freely): for a video each is clamped to the engine's own value, as qwen-vl-utils
        clamps a max_pixels over its limit.
        """
        if not kwargs:
            return self
        values: dict[str, Any] = {}
        for key in ("fps", "max_frames", "total_pixels"):
            if key not in kwargs:
                continue
            value = _check_number(key, kwargs[key], integer=key != "fps")
            ceiling = getattr(self, key)
            if value > ceiling:
                raise InvalidRequestError(
                    f"mm_processor_kwargs.{key} is {value}, over this server's limit of "
                    f"{ceiling} for videos; send at most {ceiling}",
                    param=f"mm_processor_kwargs.{key}",
                )
            values[key] = value
        for key in ("min_pixels", "max_pixels"):
            if key in kwargs:
                value = _check_number(key, kwargs[key], integer=True)
                values[key] = min(value, getattr(self, key))
        new = {**self.__dict__, **values}
        new["min_pixels"] = min(new["min_pixels"], new["max_pixels"])
        new["min_frames"] = min(self.min_frames, new["max_frames"])
        if new["max_frames"] < FRAME_FACTOR:
            raise InvalidRequestError(
                f"mm_processor_kwargs.max_frames must be at least {FRAME_FACTOR} (one temporal "
                "patch)",
                param="mm_processor_kwargs.max_frames",
            )
        return VideoConfig(**new)

    def fingerprint(self) -> tuple[str | int, ...]:
        """The sampling values (identity input: they choose which frames a video gives)."""
        return ("fps", repr(self.fps), "min_frames", self.min_frames, "max_frames", self.max_frames)


def _check_number(key: str, value: Any, *, integer: bool) -> float | int:
    ok_type = isinstance(value, int) or (not integer and isinstance(value, float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise InvalidRequestError(
            f"mm_processor_kwargs.{key} must be {kind}, got {value!r}",
            param=f"mm_processor_kwargs.{key}",
        )
    return value


def num_sampled_frames(total_frames: int, video_fps: float, cfg: VideoConfig) -> int:
    """How many frames qwen-vl-utils' smart_nframes samples from a decoded video."""
    min_frames = math.ceil(cfg.min_frames / FRAME_FACTOR) * FRAME_FACTOR
    max_frames = math.floor(min(cfg.max_frames, total_frames) / FRAME_FACTOR) * FRAME_FACTOR
    wanted = total_frames / video_fps * cfg.fps
    nframes = min(min(max(wanted, min_frames), max_frames), total_frames)
    nframes = math.floor(nframes / FRAME_FACTOR) * FRAME_FACTOR
    if not FRAME_FACTOR <= nframes <= total_frames:
        raise InvalidRequestError(
            f"the video has {total_frames} frame(s); at least {FRAME_FACTOR} are needed "
            "(send a single picture as an image)",
            param="video_url",
        )
    return nframes


def sample_indices(total_frames: int, nframes: int) -> list[int]:
    """Evenly spread frame indices, first and last included (round half to even, as torch)."""
    return [int(i) for i in np.linspace(0, total_frames - 1, nframes).round()]


def frame_max_pixels(nframes: int, cfg: VideoConfig) -> int:
    """The per-frame pixel cap once `nframes` frames share the video's total pixel budget.

    Integer division, as transformers' `cap_pixels_per_frame=True` (qwen-vl-utils divides in
    floats: smart_resize's "area over the cap" test agrees, its scale-down factor may differ
    in the last bits).
    """
    shared = cfg.total_pixels * FRAME_FACTOR // nframes
    return max(min(cfg.max_pixels, shared), int(cfg.min_pixels * MIN_PIXELS_HEADROOM))


def second_per_grid_t(nframes: int, total_frames: int, video_fps: float) -> float:
    """Seconds of video per temporal patch (transformers' `second_per_grid_ts`)."""
    sample_fps = nframes / max(total_frames, 1e-6) * video_fps
    return FRAME_FACTOR / sample_fps
