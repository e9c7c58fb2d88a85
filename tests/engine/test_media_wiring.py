"""The factory hands the decode-memory flags to the media loader, with the pixel cap resolved."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.errors import ImageTooLargeError
from tests.support.factory import flat_png

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def _config(llm: LLM):
    return llm.engine.input_processor.media_loader.config


def test_pixel_cap_defaults_to_the_larger_of_the_processor_and_4096_squared() -> None:
    toy = LLM()  # the toy processor keeps at most 12544 pixels
    assert _config(toy).max_image_pixels == 4096 * 4096
    cfg = _config(toy)
    assert (cfg.max_decode_bytes_per_request, cfg.max_inflight_decode_bytes) == (1 << 30, 2 << 30)
    assert (cfg.decode_wait_timeout, cfg.decode_worker_max_rss_mb) == (10.0, 1024)
    big = LLM(mm_processor_kwargs={"max_pixels": 5000 * 5000})
    assert _config(big).max_image_pixels == 5000 * 5000


def test_explicit_caps_reach_the_loader_and_refuse_before_decoding() -> None:
    llm = LLM(
        max_image_pixels=64 * 64,
        max_decode_bytes_per_request=4 << 20,
        max_inflight_decode_bytes=8 << 20,
        decode_wait_timeout=1.5,
        decode_worker_max_rss_mb=300,
    )
    cfg = _config(llm)
    assert (cfg.max_image_pixels, cfg.max_decode_bytes_per_request) == (4096, 4 << 20)
    assert (cfg.max_inflight_decode_bytes, cfg.decode_wait_timeout) == (8 << 20, 1.5)
    assert cfg.decode_worker_max_rss_mb == 300
    prompt = f"<|im_start|>user\n{IMG}shape?<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(max_tokens=1)
    with pytest.raises(ImageTooLargeError, match="--max-image-pixels"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": [flat_png(65, 64)]}}, params)
    out = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": [flat_png(64, 64)]}}, params
    )
    assert len(out[0].outputs[0].token_ids) == 1


VID = "<|vision_start|><|video_pad|><|vision_end|>"
SMALL = {"min_pixels": 3136, "max_pixels": 12544}


def test_video_ceilings_reach_the_loader_and_videos_run_offline(tmp_path) -> None:
    from mmserve.errors import VideoTooLargeError
    from tests.support.factory import video_bytes, video_frames

    llm = LLM(max_video_seconds=4.0, max_video_frames_decoded=50, max_video_bytes=1 << 20)
    cfg = _config(llm)
    assert (cfg.max_video_seconds, cfg.max_video_frames_decoded) == (4.0, 50)
    assert cfg.max_video_bytes == 1 << 20 and cfg.video_decode_timeout == 30.0
    assert (cfg.max_video_frame_pixels, cfg.max_video_decoded_pixels) == (4096 * 2160, 8 << 30)
    prompt = f"<|im_start|>user\n{VID}what moves?<|im_end|>\n<|im_start|>assistant\n"
    path = tmp_path / "clip.mp4"
    path.write_bytes(video_bytes(12, 32, 32, fps=4))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    inputs = [
        {"prompt": prompt, "multi_modal_data": {"video": video}, "mm_processor_kwargs": SMALL}
        for video in (str(path), video_frames(4, 32, 32))
    ]
    for out in llm.generate(inputs, params):
        assert out.finished and len(out.outputs[0].token_ids) == 2
    too_long = {**inputs[0], "multi_modal_data": {"video": video_bytes(20, 32, 32, fps=4)}}
    with pytest.raises(VideoTooLargeError, match="--max-video-seconds"):
        llm.generate(too_long, params)
