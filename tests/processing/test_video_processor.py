"""Video patches against transformers' Qwen2VLVideoProcessor on the same sampled frames."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from mmserve.processing.image_processor import ImageProcessorConfig
from mmserve.processing.media import MediaLoader
from mmserve.processing.video_processor import VideoMeta, plan_video, process_video
from mmserve.processing.video_resize import resize_frames
from mmserve.processing.video_sampling import VideoConfig, sample_indices
from tests.support.factory import video_bytes, video_frames

IMAGE_CFG = ImageProcessorConfig()


def _budget_tokens(total_pixels: int) -> int:
    """transformers' max_video_tokens for a total_pixels budget (total = tokens * 784 * 0.9)."""
    tokens = round(total_pixels / (28 * 28 * 0.9))
    assert int(tokens * 28 * 28 * 0.9) == total_pixels
    return tokens


def _oracle(frames: np.ndarray, cfg: VideoConfig) -> tuple[np.ndarray, tuple[int, ...]]:
    from transformers import Qwen2VLVideoProcessor

    hf = Qwen2VLVideoProcessor(
        size={"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels},
        max_video_tokens=_budget_tokens(cfg.total_pixels),
    )
    # do_sample_frames=False: the frames are already sampled; cap_pixels_per_frame=True is
    # its flag for qwen-vl-utils' per-frame share of the total pixel budget.
    out = hf(
        videos=[frames], do_sample_frames=False, cap_pixels_per_frame=True, return_tensors="np"
    )
    return out["pixel_values_videos"], tuple(int(v) for v in out["video_grid_thw"][0])


@pytest.mark.parametrize(
    ("num_frames", "height", "width", "cfg"),
    [
        (4, 96, 128, VideoConfig()),  # upscaled to the 128-token floor
        (5, 60, 80, VideoConfig()),  # odd: the last frame repeats
        (8, 32, 32, VideoConfig(min_pixels=3136, max_pixels=12544)),
        (6, 120, 90, VideoConfig(min_pixels=3136, total_pixels=141_120)),  # budget binds
        (20, 128, 96, VideoConfig(min_pixels=3136, total_pixels=28_224)),  # floor binds
    ],
)
def test_frames_match_the_video_processor(num_frames, height, width, cfg) -> None:
    frames = video_frames(num_frames, width, height, seed=num_frames)
    plan = plan_video(VideoMeta(width, height, num_frames, 2.0, is_sampled=True), cfg, IMAGE_CFG)
    ours = process_video(frames, plan, IMAGE_CFG)
    pixels, grid = _oracle(frames, cfg)
    assert ours.grid_thw == grid
    assert ours.pixel_values.dtype == np.uint8  # levels; the engine normalises them
    np.testing.assert_array_equal(ours.normalized(), pixels)  # bit for bit
    assert ours.second_per_grid_t == 1.0  # given frames count as sampled at 2 fps


@pytest.mark.parametrize(("num_frames", "fps", "kwargs"), [(40, 10, {}), (24, 8, {"fps": 1.0})])
def test_decoded_videos_match_on_the_frames_qwen_vl_utils_samples(num_frames, fps, kwargs) -> None:
    import av

    data = video_bytes(num_frames, 80, 64, fps=fps, seed=3)
    cfg = VideoConfig(min_pixels=3136, max_pixels=28 * 28 * 16).for_request(kwargs)
    with av.open(io.BytesIO(data)) as container:
        every = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    video = MediaLoader().load_video(data, cfg, IMAGE_CFG)
    plan = plan_video(video.meta, cfg, IMAGE_CFG)
    assert plan.frame_indices == tuple(sample_indices(num_frames, plan.num_frames))
    ours = process_video(video.frames, plan, IMAGE_CFG)
    pixels, grid = _oracle(every[list(plan.frame_indices)], cfg)
    assert ours.grid_thw == grid
    np.testing.assert_array_equal(ours.normalized(), pixels)
    seconds = num_frames / fps / plan.num_frames * 2  # video seconds per two kept frames
    assert ours.second_per_grid_t == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("shape", "size"), [((40, 60), (28, 56)), ((33, 47), (308, 420)), ((37, 1000), (28, 840))]
)
def test_resize_is_torch_uint8_antialiased_bicubic_bit_for_bit(shape, size) -> None:
    frames = np.random.default_rng(0).integers(0, 256, (2, *shape, 3), dtype=np.uint8)
    ref = torch.nn.functional.interpolate(
        torch.from_numpy(frames).permute(0, 3, 1, 2), size=size, mode="bicubic", antialias=True
    )
    np.testing.assert_array_equal(resize_frames(frames, *size), ref.permute(0, 2, 3, 1).numpy())
