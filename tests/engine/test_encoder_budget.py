"""The encoder budget in real units, seen from the engine: the start-up log states the patch
budget and the cache bytes, and an item that can never fit is refused when it arrives."""

from __future__ import annotations

import logging

import pytest

from mmserve import LLM, SamplingParams
from mmserve.errors import EncoderItemTooLargeError
from mmserve.multimodal import MultiModalFeature, PlaceholderRange, ProcessedPrompt

# Images and video frames of at most 4 merged tokens (16 patches), videos of at most 4 frames:
# the floors (the largest item a request may send, videos included) stay far below the test item.
SMALL_IMAGES = {
    "mm_processor_kwargs": {"min_pixels": 56 * 56, "max_pixels": 56 * 56, "max_frames": 4}
}


def _video_prompt(num_embeds: int, video_token_id: int) -> ProcessedPrompt:
    """A prompt whose one video item (named by identity, no pixels: admission never needs
    them) has `num_embeds` embeddings over a (2, 2, num_embeds) grid: 4 patches each."""
    grid = (2, 2, num_embeds)
    video = MultiModalFeature("f" * 64, "video", PlaceholderRange(1, num_embeds), grid)
    return ProcessedPrompt([5] + [video_token_id] * num_embeds + [6], [video])


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in_process", "multiprocess"])
def test_the_log_states_both_budgets_and_an_item_over_them_is_refused_on_arrival(
    qwen2_vl_dir, caplog, multiprocess
):
    args = {"max_num_batched_tokens": 64, "multiprocess": multiprocess, **SMALL_IMAGES}
    with caplog.at_level(logging.INFO, logger="mmserve.engine.core.build"):
        llm = LLM(model=str(qwen2_vl_dir), **args)
    with llm:
        config = llm.config
        patch_budget = config.encoder_patch_budget
        assert patch_budget == max(64 * 4, config.max_patches_per_mm_item)
        if not multiprocess:  # the engine process logs to its own stderr
            (line,) = [r.getMessage() for r in caplog.records if "input patches" in r.message]
            assert f"at most {patch_budget} input patches per step" in line
            assert f"cache {config.encoder_cache_bytes} bytes" in line
            # a slot is one encoder output row: hidden 64 x (1 + levels) x float32
            assert "embeddings of 256 bytes: hidden 64 x (1 + 0 DeepStack levels)" in line
        num_embeds = patch_budget // 4 + 1  # one embedding (4 patches) over the budget
        assert num_embeds < config.max_model_len, "the item must fit the prompt length"
        video_token_id = llm.engine.input_processor.token_ids.video_token_id
        prompt = _video_prompt(num_embeds, video_token_id)
        with pytest.raises(EncoderItemTooLargeError) as refused:
            llm.engine.add_request("big", prompt, SamplingParams(max_tokens=1))
        message = str(refused.value)
        assert f"video 1 of the prompt is {4 * num_embeds} input patches" in message
        assert f"at most {patch_budget} per step" in message
        assert "--encoder-patch-budget" in message and refused.value.param == "messages"
        assert not llm.engine.has_unfinished_requests()  # refused, not left waiting
        # the engine goes on serving
        out = llm.generate("Describe a red circle.", SamplingParams(max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
