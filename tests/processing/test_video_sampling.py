"""qwen-vl-utils' video arithmetic, with the expected numbers worked out by hand from its rules."""

from __future__ import annotations

import pytest

from mmserve.errors import InvalidRequestError
from mmserve.processing.video_sampling import (
    VIDEO_TOTAL_PIXELS,
    VideoConfig,
    frame_max_pixels,
    frame_timestamps,
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


def test_a_request_samples_at_its_own_rate_up_to_the_fps_ceiling() -> None:
    """fps 4 on a 2 s clip is above the engine's 2 fps but under --max-video-fps: honoured."""
    assert CFG.max_fps == 30.0  # --max-video-fps' default
    two_seconds = (16, 8.0)  # 16 frames at 8 fps
    assert num_sampled_frames(*two_seconds, CFG) == 4
    assert num_sampled_frames(*two_seconds, CFG.for_request({"fps": 4})) == 8
    assert num_sampled_frames(*two_seconds, CFG.for_request({"fps": 30})) == 16  # every frame
    # the frame count stays capped by max_frames: the engine's, or a lower one of the request
    ten_seconds = (300, 30.0)
    assert num_sampled_frames(*ten_seconds, CFG.for_request({"fps": 30})) == 300
    capped = VideoConfig(max_frames=64).for_request({"fps": 30})
    assert num_sampled_frames(*ten_seconds, capped) == 64
    asked = CFG.for_request({"fps": 30, "max_frames": 17})
    assert num_sampled_frames(*ten_seconds, asked) == 16
    assert sample_indices(300, 64)[-1] == 299  # a capped count still spans the whole video


@pytest.mark.parametrize(
    ("key", "value", "ceiling"),
    [
        ("fps", 30.5, "30 (--max-video-fps)"),
        ("fps", 1e300, "30 (--max-video-fps)"),  # absurd: above the ceiling too
        ("max_frames", 769, "768 (the server's max_frames)"),
        ("num_frames", 769, "768 (the server's max_frames)"),
        ("total_pixels", VIDEO_TOTAL_PIXELS + 1, "90316800 (the server's total_pixels)"),
    ],
)
def test_a_value_over_its_ceiling_is_refused_naming_field_and_ceiling(key, value, ceiling) -> None:
    with pytest.raises(InvalidRequestError, match="over this server's limit of") as info:
        CFG.for_request({key: value})
    assert info.value.param == f"mm_processor_kwargs.{key}" and ceiling in info.value.message
    with pytest.raises(InvalidRequestError) as info:
        CFG.for_request({key: value}, {key: f"media_io_kwargs.video.{key}"})
    assert info.value.param == f"media_io_kwargs.video.{key}"
    assert info.value.message.startswith(f"media_io_kwargs.video.{key} is ")


def test_the_ceiling_is_the_fps_flag_and_the_engine_rate_stays_under_it() -> None:
    strict = VideoConfig().with_server_overrides({}, max_fps=4.0)
    assert strict.for_request({"fps": 4}).fps == 4
    with pytest.raises(InvalidRequestError, match=r"limit of 4 \(--max-video-fps\)"):
        strict.for_request({"fps": 4.5})
    with pytest.raises(ValueError, match="--max-video-fps"):
        VideoConfig().with_server_overrides({"fps": 8}, max_fps=4.0)
    with pytest.raises(ValueError, match="--max-video-fps"):
        VideoConfig(max_fps=float("inf"))


def test_num_frames_samples_a_count_instead_of_a_rate() -> None:
    assert num_sampled_frames(300, 30.0, CFG.for_request({"num_frames": 8})) == 8
    assert num_sampled_frames(300, 30.0, CFG.for_request({"num_frames": 7})) == 8  # pairs
    assert num_sampled_frames(300, 30.0, CFG.for_request({"num_frames": 9})) == 8  # half to even
    assert num_sampled_frames(300, 30.0, CFG.for_request({"max_frames": 7, "num_frames": 7})) == 6
    assert num_sampled_frames(10, 30.0, CFG.for_request({"num_frames": 64})) == 10  # all it has
    # under the engine's min_frames too: a count is taken as asked
    assert num_sampled_frames(300, 30.0, CFG.for_request({"num_frames": 2})) == 2
    with pytest.raises(InvalidRequestError, match="send one of them") as info:
        CFG.for_request({"num_frames": 8, "fps": 1})
    assert info.value.param == "mm_processor_kwargs.num_frames"
    with pytest.raises(InvalidRequestError, match="over max_frames"):
        CFG.for_request({"num_frames": 16, "max_frames": 8})
    with pytest.raises(InvalidRequestError, match="at least 2"):
        CFG.for_request({"num_frames": 1})


def test_a_request_fps_is_the_timing_of_given_frames() -> None:
    assert CFG.frames_fps == 2.0
    assert CFG.for_request({"fps": 4}).frames_fps == 4.0
    assert CFG.for_request({"max_frames": 8}).frames_fps == 2.0
    assert frame_timestamps([0, 3, 6], 4.0) == [0.0, 0.75, 1.5]


def test_pixels_and_frames_within_the_ceilings() -> None:
    lowered = CFG.for_request({"max_frames": 16, "fps": 1, "total_pixels": 10**6})
    assert (lowered.max_frames, lowered.fps, lowered.total_pixels) == (16, 1, 10**6)
    # shared with images, so clamped rather than refused
    clamped = CFG.for_request({"max_pixels": 10**9, "min_pixels": 10**8})
    assert (clamped.min_pixels, clamped.max_pixels) == (CFG.min_pixels, CFG.max_pixels)
    with pytest.raises(InvalidRequestError, match="at least 2"):
        CFG.for_request({"max_frames": 1})


@pytest.mark.parametrize("key", ["fps", "num_frames", "max_frames", "total_pixels", "max_pixels"])
@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "4", True, None, [4]])
def test_bad_values_name_their_field(key, bad) -> None:
    if key == "fps" and bad == float("inf"):
        bad = float("-inf")
    with pytest.raises(InvalidRequestError, match="must be a positive") as info:
        CFG.for_request({key: bad})
    assert info.value.param == f"mm_processor_kwargs.{key}"
    if key != "fps":  # counts and pixels are integers
        with pytest.raises(InvalidRequestError, match="must be a positive integer"):
            CFG.for_request({key: 4.5})


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"fps": 4}, {"fps": 8}, {"fps": 30}, {"fps": 30, "max_frames": 10}, {"fps": 0.5},
     {"num_frames": 12}, {"num_frames": 7}, {"num_frames": 9}, {"num_frames": 16}],
)  # fmt: skip
def test_frame_counts_match_transformers_sample_frames(kwargs) -> None:
    """transformers' Qwen2VLVideoProcessor.sample_frames (qwen-vl-utils' counts) is the oracle
    for how many frames a rate or a count keeps of a 2 s clip of 16 frames at 8 fps."""
    from transformers import Qwen2VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    cfg = CFG.for_request(kwargs)
    hf_kwargs = {k: v for k, v in kwargs.items() if k in ("fps", "num_frames", "max_frames")}
    if "num_frames" not in hf_kwargs:
        hf_kwargs.setdefault("fps", cfg.fps)
    indices = Qwen2VLVideoProcessor().sample_frames(
        VideoMetadata(total_num_frames=16, fps=8.0), **hf_kwargs
    )
    assert num_sampled_frames(16, 8.0, cfg) == len(indices)
