"""Video decoding under the engine ceilings: hostile containers fail fast with a typed 4xx."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image

from mmserve.config.media import MediaConfig, VideoLimits
from mmserve.errors import VideoDecodeError, VideoTooLargeError
from mmserve.processing.decode_workers import DecodeWorkerPool
from mmserve.processing.image_processor import ImageProcessorConfig
from mmserve.processing.video_decode import decode_video_bytes
from mmserve.processing.video_sampling import VideoConfig
from mmserve.processing.video_worker import decode_video_in_worker
from tests.support.factory import huge_frame_header, video_bytes

IMAGE_CFG = ImageProcessorConfig()
CFG = VideoConfig(min_pixels=3136, max_pixels=12544)


def video_limits(**ceilings) -> VideoLimits:
    """The engine's video ceilings, some lowered."""
    return MediaConfig(**ceilings).video_limits


def _decode(data: bytes, limits: VideoLimits | None = None):
    return decode_video_bytes(data, CFG, IMAGE_CFG, limits or video_limits())


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def test_a_video_keeps_only_its_sampled_frames_at_the_planned_size() -> None:
    video = _decode(video_bytes(20, 64, 48, fps=10))
    assert video.frames.shape == (4, 56, 56, 3)  # 2 s at fps 2, resized within max_pixels
    assert (video.meta.total_frames, video.meta.video_fps) == (20, 10.0)
    webm = _decode(video_bytes(6, 32, 32, fps=2, codec="libvpx", container="webm"))
    assert webm.frames.shape[0] == 6  # 3 s at 2 fps: every frame


@pytest.mark.parametrize(
    ("data", "error", "match"),
    [
        (video_bytes(11, 32, 32, fps=1, seconds_per_frame=3600), VideoTooLargeError, "duration"),
        (huge_frame_header(), VideoTooLargeError, "8000x8000"),
        (video_bytes(20)[:1500], VideoDecodeError, "truncated"),
        (b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4, VideoDecodeError, "corrupt"),
        (_png(), VideoDecodeError, "not a supported video container"),
        (np.random.default_rng(0).bytes(4096), VideoDecodeError, "not a supported video"),
        (b"", VideoDecodeError, "empty"),
        (b"#EXTM3U\n#EXT-X-TARGETDURATION:1\nhttp://127.0.0.1:1/x.ts\n", VideoDecodeError, "not a"),
    ],
    ids=["ten-hours", "8000x8000", "truncated", "bad-mp4", "png", "random", "empty", "playlist"],
)
def test_hostile_containers_fail_fast_and_typed(data: bytes, error: type, match: str) -> None:
    start = time.monotonic()
    with pytest.raises(error, match=match) as info:
        _decode(data)
    assert time.monotonic() - start < 2.0
    assert info.value.status_code == 400 and info.value.param == "video_url"


def test_every_ceiling_is_enforced() -> None:
    data = video_bytes(40, 64, 48, fps=10)  # 4 s, 40 frames of 3072 pixels
    _decode(data, video_limits(max_video_frames_decoded=40, max_video_decoded_pixels=40 * 3072))
    for limits, match in [
        (video_limits(max_video_bytes=len(data) - 1), "size \\(bytes\\)"),
        (video_limits(max_video_seconds=3.5), "duration"),
        (video_limits(max_video_frames_decoded=39), "frame count"),
        (video_limits(max_video_frame_pixels=64 * 48 - 1), "frame size"),
        (video_limits(max_video_decoded_pixels=40 * 3072 - 1), "decoded pixel"),
    ]:
        with pytest.raises(VideoTooLargeError, match=match):
            _decode(data, limits)


def test_worker_decodes_the_same_frames_and_survives_hostile_input() -> None:
    data = video_bytes(20, 64, 48, fps=10)
    pool = DecodeWorkerPool(1, timeout_s=10.0, max_rss_bytes=0)
    try:
        admitted = []

        def admit(header, plan):
            admitted.append((header.meta.total_frames, plan.num_frames, header.decode_bytes(plan)))

        video = decode_video_in_worker(pool, data, CFG, IMAGE_CFG, video_limits(), admit=admit)
        np.testing.assert_array_equal(video.frames, _decode(data).frames)
        assert admitted[0][:2] == (20, 4) and admitted[0][2] > 4 * 56 * 56 * 3
        with pytest.raises(VideoTooLargeError, match="8000x8000") as info:
            decode_video_in_worker(pool, huge_frame_header(), CFG, IMAGE_CFG, video_limits())
        assert info.value.param == "video_url"
        with pytest.raises(VideoDecodeError, match="truncated"):
            decode_video_in_worker(pool, data[:1500], CFG, IMAGE_CFG, video_limits())
        with pytest.raises(VideoDecodeError, match="at least 2"):  # the plan refuses it
            decode_video_in_worker(pool, video_bytes(1), CFG, IMAGE_CFG, video_limits())
        with pytest.raises(VideoDecodeError, match="aspect ratio"):
            decode_video_in_worker(pool, video_bytes(4, 640, 2), CFG, IMAGE_CFG, video_limits())
        again = decode_video_in_worker(pool, data, CFG, IMAGE_CFG, video_limits())
        np.testing.assert_array_equal(again.frames, video.frames)
        assert pool.num_started == 1  # refusals do not cost the worker
    finally:
        pool.close()
