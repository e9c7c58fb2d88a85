"""Qwen2-VL's video arithmetic (qwen-vl-utils' rules): frames sampled, frame size, time per patch.

The numbers are qwen-vl-utils' (vision_process.py), the reference the Qwen2-VL and Qwen2.5-VL
checkpoints were trained and evaluated with; transformers' Qwen2VLVideoProcessor has the same
defaults (its `size`, `fps`, `min_frames`, `max_frames`, `max_video_tokens`).

    nframes  = total_frames / video_fps * fps          frames at `fps` per second of video
             = clamp(nframes, min_frames, min(max_frames, total_frames))
             = floor to a multiple of FRAME_FACTOR     (two frames fold into one temporal patch)
    or, when a request gives num_frames (instead of fps):
    nframes  = min(round(num_frames / FRAME_FACTOR) * FRAME_FACTOR, the max_frames above)
    indices  = round(linspace(0, total_frames - 1, nframes))
    per-frame max pixels = max(min(max_pixels, total_pixels * FRAME_FACTOR // nframes),
                               int(min_pixels * 1.05))
    second_per_grid_t = temporal_patch_size / sample_fps,  sample_fps = nframes / total * video_fps

Frames given as an array are taken as already sampled at FPS (2 per second, so one temporal
patch is one second), as vLLM and qwen-vl-utils assume, or at a request's fps (their timing,
as vLLM reads media_io_kwargs fps for frames); an odd count is padded with its last frame
(what transformers' patchify does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mmserve.config.media import DEFAULT_MAX_VIDEO_FPS
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
VIDEO_KEYS = ("fps", "num_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels")
# Each request key with a ceiling: the VideoConfig field that holds it, its name in a refusal.
_CEILINGS = {
    "fps": ("max_fps", "--max-video-fps"),
    "num_frames": ("max_frames", "the server's max_frames"),
    "max_frames": ("max_frames", "the server's max_frames"),
    "total_pixels": ("total_pixels", "the server's total_pixels"),
}


@dataclass(frozen=True)
class VideoConfig:
    """How a video becomes frames: the engine's values (each also a ceiling for requests,
    the sampling rate's being `max_fps`), and what one request set of them.

    `num_frames`: a request's exact frame count, sampled instead of a rate. `frames_fps`: the
    rate at which frames given as a list were taken (their timing; a request's fps sets it).
    """

    fps: float = FPS
    # Qwen3-VL's rules (video_timestamps.py): frames sampled as its video processor does, the
    # pixel limits over the whole clip, each temporal patch a group led by its time as text.
    timestamps: bool = False
    min_frames: int = FPS_MIN_FRAMES
    max_frames: int = FPS_MAX_FRAMES
    min_pixels: int = VIDEO_MIN_PIXELS
    max_pixels: int = VIDEO_MAX_PIXELS
    total_pixels: int = VIDEO_TOTAL_PIXELS
    max_fps: float = DEFAULT_MAX_VIDEO_FPS
    num_frames: int | None = None
    frames_fps: float = FPS

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_fps) and self.max_fps > 0):
            raise ValueError(f"--max-video-fps must be a positive number, got {self.max_fps}")
        if not (math.isfinite(self.fps) and 0 < self.fps <= self.max_fps):
            raise ValueError(
                f"the video fps ({self.fps}) must be in (0, --max-video-fps {self.max_fps:g}]: "
                "raise --max-video-fps or lower the video processor's fps"
            )
        if not (math.isfinite(self.frames_fps) and self.frames_fps > 0):
            raise ValueError(f"video frames_fps must be a positive number, got {self.frames_fps}")
        for name in ("min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"video {name} must be a positive integer, got {value!r}")
        if self.max_frames < FRAME_FACTOR or self.min_frames > self.max_frames:
            raise ValueError(
                f"video max_frames ({self.max_frames}) must be >= {FRAME_FACTOR} and >= "
                f"min_frames ({self.min_frames})"
            )
        if self.num_frames is not None and not FRAME_FACTOR <= self.num_frames <= self.max_frames:
            raise ValueError(f"video num_frames must be in [2, max_frames], got {self.num_frames}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"video min_pixels ({self.min_pixels}) must not exceed max_pixels "
                f"({self.max_pixels})"
            )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> VideoConfig:
        """From a video_preprocessor_config.json (transformers' names). Its fps is checked
        against --max-video-fps by `with_server_overrides`, after --mm-processor-kwargs."""
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
            kwargs["max_fps"] = max(kwargs["fps"], DEFAULT_MAX_VIDEO_FPS)
        return cls(**kwargs)

    def with_server_overrides(
        self, overrides: Mapping[str, Any] | None, max_fps: float = DEFAULT_MAX_VIDEO_FPS
    ) -> VideoConfig:
        """`--mm-processor-kwargs`: its video keys (fps, max_frames, total_pixels) set the
        engine's values. min_pixels / max_pixels there are shared with the image processor
        (as a Hugging Face processor's top-level kwargs are): for videos they can only lower
        the per-frame bounds, so capping images never lets a frame grow past its video
        default (768 x 28 x 28 pixels). `max_fps`: --max-video-fps."""
        overrides = overrides or {}
        if "num_frames" in overrides:
            raise ValueError(
                "--mm-processor-kwargs: num_frames is a request's choice; set the server's "
                "fps and max_frames instead"
            )
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
            return replace(self, max_fps=max_fps, **picked)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--mm-processor-kwargs: {exc}") from None

    def for_request(
        self, kwargs: Mapping[str, Any] | None, params: Mapping[str, str] | None = None
    ) -> VideoConfig:
        """One request's video keys applied, up to the server's ceilings (docs/video.md).

        fps up to --max-video-fps, num_frames and max_frames up to the server's max_frames,
        total_pixels up to the server's: a value above its ceiling is refused (400 naming the
        key and the ceiling), because clamping it would silently sample fewer or smaller
        frames than the request's own values give (CVE-2026-34755 was a request that raised
        the frame cap). A rate the server's max_frames cuts short is the sampling rule itself
        (num_sampled_frames), not a clamp. min_pixels and max_pixels are shared with images
        (where a request may set them freely): for a video each is clamped to the server's
        per-frame value, as qwen-vl-utils clamps a max_pixels over its limit.
        `params`: each key's field in the request, for errors (else mm_processor_kwargs.KEY).
        """
        if not kwargs:
            return self
        params = params or {}

        def param(key: str) -> str:
            return params.get(key, f"mm_processor_kwargs.{key}")

        values: dict[str, Any] = {}
        for key, (field, name) in _CEILINGS.items():
            if key not in kwargs:
                continue
            value = _check_number(param(key), kwargs[key], integer=key != "fps")
            ceiling = getattr(self, field)
            if value > ceiling:
                shown, limit = _show(value), _show(ceiling)
                raise InvalidRequestError(
                    f"{param(key)} is {shown}, over this server's limit of {limit} ({name}) "
                    f"for videos; send at most {limit}",
                    param=param(key),
                )
            values[key] = value
        if "fps" in values and "num_frames" in values:
            raise InvalidRequestError(
                f"{param('fps')} and {param('num_frames')} both choose how many frames are "
                "sampled; send one of them",
                param=param("num_frames"),
            )
        for key in ("min_pixels", "max_pixels"):
            if key in kwargs:
                value = _check_number(param(key), kwargs[key], integer=True)
                values[key] = min(value, getattr(self, key))
        if "fps" in values:
            values["frames_fps"] = values["fps"]
        new = {**self.__dict__, **values}
        new["min_pixels"] = min(new["min_pixels"], new["max_pixels"])
        new["min_frames"] = min(self.min_frames, new["max_frames"])
        for key in ("max_frames", "num_frames"):
            if key in values and values[key] < FRAME_FACTOR:
                raise InvalidRequestError(
                    f"{param(key)} must be at least {FRAME_FACTOR} (one temporal patch)",
                    param=param(key),
                )
        if new["num_frames"] is not None and new["num_frames"] > new["max_frames"]:
            raise InvalidRequestError(
                f"{param('num_frames')} ({new['num_frames']}) is over max_frames "
                f"({new['max_frames']}); send at most max_frames frames",
                param=param("num_frames"),
            )
        return VideoConfig(**new)


def _show(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _check_number(param: str, value: Any, *, integer: bool) -> float | int:
    ok_type = isinstance(value, int) or (not integer and isinstance(value, float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise InvalidRequestError(f"{param} must be {kind}, got {value!r}", param=param)
    return value


def num_sampled_frames(total_frames: int, video_fps: float, cfg: VideoConfig) -> int:
    """How many frames qwen-vl-utils' smart_nframes samples from a decoded video: at the rate
    `cfg.fps`, or a request's `num_frames` (no more than the video has), floored to pairs."""
    max_frames = math.floor(min(cfg.max_frames, total_frames) / FRAME_FACTOR) * FRAME_FACTOR
    if cfg.num_frames is not None:
        # rounded to pairs as transformers and qwen-vl-utils round it (half to even); a count
        # above what the video has keeps every frame it has, as vLLM's loader does
        nframes = min(round(cfg.num_frames / FRAME_FACTOR) * FRAME_FACTOR, max_frames)
        return _checked_count(nframes, total_frames)
    min_frames = math.ceil(cfg.min_frames / FRAME_FACTOR) * FRAME_FACTOR
    wanted = total_frames / video_fps * cfg.fps
    nframes = min(min(max(wanted, min_frames), max_frames), total_frames)
    nframes = math.floor(nframes / FRAME_FACTOR) * FRAME_FACTOR
    return _checked_count(nframes, total_frames)


def _checked_count(nframes: int, total_frames: int) -> int:
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


def frame_timestamps(frame_indices: Sequence[int], fps: float) -> list[float]:
    """Seconds from the start of the video of each kept frame: its index over the rate the
    frames were taken at (the container's rate, or `frames_fps` for frames given as a list)."""
    return [idx / fps for idx in frame_indices]


def second_per_grid_t(nframes: int, total_frames: int, video_fps: float) -> float:
    """Seconds of video per temporal patch (transformers' `second_per_grid_ts`)."""
    sample_fps = nframes / max(total_frames, 1e-6) * video_fps
    return FRAME_FACTOR / sample_fps
