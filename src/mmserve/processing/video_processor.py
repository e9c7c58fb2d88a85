"""One video -> its plan (frames, frame size, grid, tokens) and its encoder input (patches).

Patches are laid out exactly as transformers' Qwen2VLVideoProcessor lays out
`pixel_values_videos` (called with `do_sample_frames=False` on the same sampled frames and
`cap_pixels_per_frame=True`, its flag for qwen-vl-utils' per-frame cap):

    frames [n, H, W, C] uint8 --resize--> [n, h, w, C] --pad to a multiple of T (last frame)-->
    rows [grid_t, h/P/m, w/P/m, m, m] (a merge block's patches contiguous), each row
    [C, T, P, P] flattened, uint8 levels; the engine computes transformers' values
    (level - mean * 255) / (std * 255) in float32 (`PixelNormalization`, "normalize_scaled")
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from mmserve.errors import InvalidRequestError
from mmserve.grid import grid_num_tokens
from mmserve.multimodal import EncoderInput
from mmserve.processing.image_processor import ImageProcessorConfig, smart_resize
from mmserve.processing.video_resize import resize_frames
from mmserve.processing.video_sampling import (
    VideoConfig,
    frame_max_pixels,
    num_sampled_frames,
    sample_indices,
    second_per_grid_t,
)
from mmserve.processing.video_timestamps import (
    clip_max_pixels,
    clip_smart_resize,
    group_times,
    linspace_indices,
    num_timestamped_frames,
    sample_times,
)


@dataclass(frozen=True, slots=True)
class VideoMeta:
    """What is known of a video before its frames are decoded (its container's header), and
    what a UUID-only reference keeps to plan the video again under another request's kwargs.

    `is_sampled`: the frames were given as an array, already sampled (at FPS, or at a
    request's fps: `VideoConfig.frames_fps`); then `total_frames` is their count.
    """

    width: int
    height: int
    total_frames: int
    video_fps: float
    is_sampled: bool = False
    # (index, seconds) of each frame the decoder kept, from its presentation time (empty
    # before decoding, and for frames given as an array)
    frame_times: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class VideoPlan:
    """What processing does to a video, known from its meta alone (no frame decoded)."""

    frame_indices: tuple[int, ...]  # the frames kept, in the video's own numbering
    resized_hw: tuple[int, int]
    grid_thw: tuple[int, int, int]
    num_tokens: int
    second_per_grid_t: float
    group_times: tuple[float, ...] = ()  # seconds of each temporal patch (timestamps only)

    @property
    def num_frames(self) -> int:
        return len(self.frame_indices)


def plan_video(meta: VideoMeta, cfg: VideoConfig, image_cfg: ImageProcessorConfig) -> VideoPlan:
    """Frames to keep, their size, and the grid: qwen-vl-utils' rules (video_sampling.py), or
    Qwen3-VL's where the configuration says timestamps (video_timestamps.py)."""
    if cfg.timestamps:
        return _plan_timestamped(meta, cfg, image_cfg)
    if meta.is_sampled:
        nframes = meta.total_frames
        if cfg.num_frames is not None:
            raise InvalidRequestError(
                "num_frames samples a decoded video; frames given as a list are kept as "
                "given (send fewer frames instead)",
                param="mm_processor_kwargs.num_frames",
            )
        if nframes > cfg.max_frames:
            raise InvalidRequestError(
                f"the video has {nframes} frames, over the limit of {cfg.max_frames} "
                "(max_frames); send fewer frames",
                param="multi_modal_data",
            )
        indices = tuple(range(nframes))
        seconds = image_cfg.temporal_patch_size / cfg.frames_fps
    else:
        nframes = num_sampled_frames(meta.total_frames, meta.video_fps, cfg)
        indices = tuple(sample_indices(meta.total_frames, nframes))
        seconds = second_per_grid_t(nframes, meta.total_frames, meta.video_fps)
    resized_h, resized_w = smart_resize(
        meta.height,
        meta.width,
        factor=image_cfg.factor,
        min_pixels=cfg.min_pixels,
        max_pixels=frame_max_pixels(nframes, cfg),
    )
    t = image_cfg.temporal_patch_size
    grid = (
        math.ceil(nframes / t),
        resized_h // image_cfg.patch_size,
        resized_w // image_cfg.patch_size,
    )
    num_tokens = grid_num_tokens(grid, image_cfg.merge_size)
    return VideoPlan(indices, (resized_h, resized_w), grid, num_tokens, seconds)


def _plan_timestamped(
    meta: VideoMeta, cfg: VideoConfig, image_cfg: ImageProcessorConfig
) -> VideoPlan:
    t = image_cfg.temporal_patch_size
    if meta.is_sampled:
        _check_given_frames(meta.total_frames, cfg)
        indices = tuple(range(meta.total_frames))
        meta = replace(meta, video_fps=cfg.frames_fps)  # their times: index / frames_fps
    else:
        nframes = num_timestamped_frames(meta.total_frames, meta.video_fps, cfg)
        indices = linspace_indices(meta.total_frames, nframes)
    nframes = len(indices)
    resized_h, resized_w = clip_smart_resize(
        nframes,
        meta.height,
        meta.width,
        factor=image_cfg.factor,
        temporal_factor=t,
        min_pixels=cfg.min_pixels,
        max_pixels=clip_max_pixels(cfg),
    )
    grid = (
        math.ceil(nframes / t),
        resized_h // image_cfg.patch_size,
        resized_w // image_cfg.patch_size,
    )
    times = sample_times(indices, meta.video_fps, dict(meta.frame_times))
    if meta.is_sampled:
        seconds = t / cfg.frames_fps
    else:
        seconds = second_per_grid_t(nframes, meta.total_frames, meta.video_fps)
    return VideoPlan(
        indices,
        (resized_h, resized_w),
        grid,
        grid_num_tokens(grid, image_cfg.merge_size),
        seconds,
        group_times(times, t),
    )


def _check_given_frames(nframes: int, cfg: VideoConfig) -> None:
    if nframes > cfg.max_frames:
        raise InvalidRequestError(
            f"the video has {nframes} frames, over the limit of {cfg.max_frames} "
            "(max_frames); send fewer frames",
            param="multi_modal_data",
        )


def process_video(frames: np.ndarray, plan: VideoPlan, cfg: ImageProcessorConfig) -> EncoderInput:
    """[n, H, W, 3] uint8 sampled frames -> patches [grid_t * grid_h * grid_w, C * T * P * P]."""
    assert frames.dtype == np.uint8 and frames.ndim == 4 and frames.shape[3] == 3, frames.shape
    assert frames.shape[0] == plan.num_frames, (frames.shape, plan.num_frames)
    h, w = plan.resized_hw
    frames = resize_frames(frames, h, w)
    t, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if pad := -frames.shape[0] % t:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    grid_t, grid_h, grid_w = plan.grid_thw
    # [gt, T, gh/m, m, P, gw/m, m, P, C] -> [gt, gh/m, gw/m, m, m, C, T, P, P]
    blocks = frames.reshape(grid_t, t, grid_h // m, m, p, grid_w // m, m, p, 3)
    blocks = blocks.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    rows = blocks.reshape(grid_t * grid_h * grid_w, 3 * t * p * p)  # uint8, one copy
    return EncoderInput(
        pixel_values=rows,
        grid_thw=plan.grid_thw,
        normalization=cfg.video_normalization,
        second_per_grid_t=plan.second_per_grid_t,
    )
