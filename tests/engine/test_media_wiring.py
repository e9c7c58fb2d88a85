"""The factory hands the decode-memory flags to the media loader, with the pixel cap resolved."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.errors import ImageTooLargeError
from tests.factory import flat_png

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def _config(llm: LLM):
    return llm.engine.input_processor.media_loader.config


def test_pixel_cap_defaults_to_the_larger_of_the_processor_and_4096_squared() -> None:
    toy = LLM()  # the toy processor keeps at most 12544 pixels
    assert _config(toy).max_image_pixels == 4096 * 4096
    cfg = _config(toy)
    assert (cfg.max_decode_bytes_per_request, cfg.max_inflight_decode_bytes) == (1 << 30, 2 << 30)
    assert (cfg.decode_wait_timeout_s, cfg.decode_worker_max_rss_bytes) == (10.0, 1 << 30)
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
    assert (cfg.max_inflight_decode_bytes, cfg.decode_wait_timeout_s) == (8 << 20, 1.5)
    assert cfg.decode_worker_max_rss_bytes == 300 << 20
    prompt = f"<|im_start|>user\n{IMG}shape?<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(max_tokens=1)
    with pytest.raises(ImageTooLargeError, match="--max-image-pixels"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": [flat_png(65, 64)]}}, params)
    out = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": [flat_png(64, 64)]}}, params
    )
    assert len(out[0].outputs[0].token_ids) == 1
