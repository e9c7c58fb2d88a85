"""qwen-vl-utils' video arithmetic, with the expected numbers worked out by hand from its rules."""

from __future__ import annotations

import pytest

from mmserve.errors import InvalidRequestError
from mmserve.processing.video_sampling import (
    VIDEO_TOTAL_PIXELS,
    VideoConfig,
    frame_max_pixels,
    num_sampled_frames,
    sample_indices,
    second_per_grid_t,
)

CFG = VideoConfig()


@pytest.mark.parametrize(
    ("total_frames", "video_fps", "kwargs", "expected"),
    [
        (300, 30.0, {}, 20),  # 10 s at fps 2 -> 20
        (30, 30.0, {}, 4),  # 1 s -> 2 frames, raised to FPS_MIN_FRAMES 4
        (3, 30.0, {}, 2),  # 4 wanted, but the video has 3: floor(3 / 2) * 2
        (30_000, 30.0, {}, 768),  # 1000 s -> 2000, capped at FPS_MAX_FRAMES
        (300, 30.0, {"fps": 0.5}, 4),  # 5 -> floored to the frame factor: 4
        (300, 30.0, {"fps": 1.0}, 10),
        (300, 30.0, {"max_frames": 7}, 6),  # max_frames floored to the factor first
        (250, 25.0, {"fps": 1.3}, 12),  # 13 -> 12
    ],
)
def test_frame_counts_follow_smart_nframes(total_frames, video_fps, kwargs, expected) -> None:
    cfg = CFG.for_request(kwargs)
    assert num_sampled_frames(total_frames, video_fps, cfg) == expected


def test_indices_spread_over_the_whole_video() -> None:
    assert sample_indices(300, 20)[:4] == [0, 16, 31, 47]  # 299 / 19 = 15.74 per step
    assert sample_indices(300, 20)[-1] == 299
    assert sample_indices(10, 4) == [0, 3, 6, 9]
    assert sample_indices(4, 4) == [0, 1, 2, 3]


def test_a_single_frame_is_not_a_video() -> None:
    with pytest.raises(InvalidRequestError, match="at least 2"):
        num_sampled_frames(1, 30.0, CFG)


def test_frames_share_the_total_pixel_budget() -> None:
    assert VIDEO_TOTAL_PIXELS == 90_316_800  # 128000 tokens * 28 * 28 * 0.9
    assert frame_max_pixels(4, CFG) == 768 * 28 * 28  # the per-frame cap binds
    assert frame_max_pixels(768, CFG) == 90_316_800 * 2 // 768 == 235_200  # the budget binds
    tight = VideoConfig(total_pixels=1_000_000)
    assert frame_max_pixels(768, tight) == int(128 * 28 * 28 * 1.05)  # floored at 1.05 x min


def test_seconds_per_temporal_patch() -> None:
    assert second_per_grid_t(20, 300, 30.0) == pytest.approx(1.0)  # sampled at 2 fps
    assert second_per_grid_t(10, 300, 30.0) == pytest.approx(2.0)  # at 1 fps
    assert second_per_grid_t(4, 30, 30.0) == pytest.approx(0.5)  # 4 frames of a 1 s video


def test_requests_only_lower_the_engine_values() -> None:
    for key, value in [("max_frames", 769), ("fps", 2.5), ("total_pixels", VIDEO_TOTAL_PIXELS + 1)]:
        with pytest.raises(InvalidRequestError, match="over this server's limit") as info:
            CFG.for_request({key: value})
        assert info.value.param == f"mm_processor_kwargs.{key}"
    lowered = CFG.for_request({"max_frames": 16, "fps": 1, "total_pixels": 10**6})
    assert (lowered.max_frames, lowered.fps, lowered.total_pixels) == (16, 1, 10**6)
    # shared with images, so clamped rather than refused
    clamped = CFG.for_request({"max_pixels": 10**9, "min_pixels": 10**8})
    assert (clamped.min_pixels, clamped.max_pixels) == (CFG.min_pixels, CFG.max_pixels)
    for bad in ({"fps": 0}, {"max_frames": "8"}, {"max_frames": True}, {"fps": float("nan")}):
        with pytest.raises(InvalidRequestError, match="must be a positive"):
            CFG.for_request(bad)
    with pytest.raises(InvalidRequestError, match="at least 2"):
        CFG.for_request({"max_frames": 1})
