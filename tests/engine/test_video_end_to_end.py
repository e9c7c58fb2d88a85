"""Videos through mmserve's whole path (`LLM.generate`: our processing, placeholders, M-RoPE,
scheduling, the engine) against transformers' processors and `generate` on the same frames.

test_video_parity.py checks the engine alone on prompts transformers built; this file checks
that our own processing feeds it the same thing, so together they cover both halves.
"""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from tests.engine.video_oracle import IMG, VID, build_case, oracle_greedy, random_video
from tests.support.factory import random_image
from tests.support.parity_cases import chat

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
FRAME_PIXELS = 112 * 112  # 112x84 frames stay 112x84: grid (t, 6, 8)
KWARGS = {"min_pixels": 56 * 56, "max_pixels": FRAME_PIXELS}


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in_process", "multiprocess"])
def test_frames_through_llm_generate_match_transformers(diverse_checkpoint, oracle, multiprocess):
    """A 4-frame video beside an image, and the same video alone in a second request, in one
    batch with 16-token chunks (the chunks cut through the video).

    Two temporal patches: from three on, transformers 5 resumes Qwen2.5-VL's text positions
    after a video one lower than the original Qwen code and vLLM do (mmserve follows those),
    so longer videos are no common ground for a token-for-token comparison."""
    video = random_video(4, 112, 84, seed=21)
    image = random_image(56, 84, seed=22)
    both_text = chat(f"{IMG}Is this{VID} the same?")
    alone_text = chat(f"{VID}What happens?")
    cases = [
        build_case(oracle, both_text, [image], [video], max_pixels=FRAME_PIXELS),
        build_case(oracle, alone_text, [], [video], max_pixels=FRAME_PIXELS),
    ]
    expected = [oracle_greedy(oracle, c, NUM_TOKENS) for c in cases]
    requests = [
        {"prompt": both_text, "multi_modal_data": {"image": image, "video": video}},
        {"prompt": alone_text, "multi_modal_data": {"video": list(video)}},  # a list of frames
    ]
    args = {
        "max_num_batched_tokens": 16,
        "multiprocess": multiprocess,
        "mm_processor_kwargs": KWARGS,
    }
    with LLM(model=str(diverse_checkpoint), **args) as llm:
        outs = llm.generate(requests, GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        if not multiprocess:
            counters = llm.engine.metrics.snapshot().modality_counters["encoder_items_encoded"]
            assert counters["video"] == 1  # the shared video was encoded once


def test_an_odd_frame_count_is_padded_like_transformers(diverse_checkpoint, oracle):
    """3 frames: the last is repeated to fill the second temporal patch, as the oracle does."""
    video = random_video(3, 112, 84, seed=23)
    text = chat(f"{VID}What happens?")
    expected = oracle_greedy(
        oracle, build_case(oracle, text, [], [video], max_pixels=FRAME_PIXELS), NUM_TOKENS
    )
    with LLM(model=str(diverse_checkpoint), mm_processor_kwargs=KWARGS) as llm:
        request = {"prompt": text, "multi_modal_data": {"video": video}}
        out = llm.generate(request, GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == expected
