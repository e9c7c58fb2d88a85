"""Videos through the engine core: greedy output equals transformers' `generate`, both
architectures, on prompts built by transformers' own processors (see video_oracle.py)."""

from __future__ import annotations

import time

import pytest

from mmserve import LLM, SamplingParams
from mmserve.engine.frontend.outputs import OutputKind
from mmserve.multimodal import ProcessedPrompt
from tests.engine.video_oracle import IMG, VID, build_case, oracle_greedy, random_video
from tests.support.factory import random_image
from tests.support.parity_cases import chat

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
MAX_VIDEO_PIXELS = 112 * 112  # per frame: 4 frames of 112x84 stay 112x84, grid (2, 6, 8)


def generate(llm: LLM, prompts: list[ProcessedPrompt]) -> list[list[int]]:
    """Already processed prompts through the engine (LLMEngine.add_request), all in one batch."""
    ids = [f"video-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        llm.engine.add_request(request_id, prompt, GREEDY, output_kind=OutputKind.FINAL_ONLY)
    done: dict[str, list[int]] = {}
    deadline = time.monotonic() + 60
    for _ in range(10_000):
        if len(done) == len(ids) or time.monotonic() > deadline:
            break
        for out in llm.engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert set(done) == set(ids), "the engine did not finish every request in time"
    return [done[i] for i in ids]


@pytest.fixture
def one_video(oracle):
    video = random_video(4, 112, 84, seed=5)
    return build_case(oracle, chat(f"{VID}What happens?"), [], [video], max_pixels=MAX_VIDEO_PIXELS)


@pytest.fixture
def video_and_image(oracle):
    return build_case(
        oracle,
        chat(f"{IMG}Is this{VID} the same?"),
        [random_image(56, 84, seed=6)],
        [random_video(4, 112, 84, seed=7)],
        max_pixels=MAX_VIDEO_PIXELS,
    )


def test_one_video_and_video_plus_image_match_transformers(
    diverse_checkpoint, oracle, one_video, video_and_image
):
    expected = [oracle_greedy(oracle, c, NUM_TOKENS) for c in (one_video, video_and_image)]
    with LLM(model=str(diverse_checkpoint)) as llm:
        assert generate(llm, [one_video.prompt]) == expected[:1]
        assert generate(llm, [video_and_image.prompt]) == expected[1:]
    other = build_case(
        oracle,
        chat(f"{VID}What happens?"),
        [],
        [random_video(4, 112, 84, seed=8)],
        max_pixels=MAX_VIDEO_PIXELS,
    )
    assert oracle_greedy(oracle, other, NUM_TOKENS) != expected[0]  # the frames matter


def test_two_requests_sharing_a_video_encode_it_once(diverse_checkpoint, oracle, one_video):
    expected = oracle_greedy(oracle, one_video, NUM_TOKENS)
    with LLM(model=str(diverse_checkpoint)) as llm:
        assert generate(llm, [one_video.prompt, one_video.prompt]) == [expected, expected]
        counters = llm.engine.metrics.snapshot().counters
    assert counters["encoder_items_encoded"] == 1


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in_process", "multiprocess"])
def test_chunked_prefill_cutting_through_a_video_matches_transformers(
    diverse_checkpoint, oracle, video_and_image, multiprocess
):
    """16-token chunks cut the 24-embedding video; with the core in its own process the
    video's pixels, modality and second_per_grid_t cross the wire."""
    expected = oracle_greedy(oracle, video_and_image, NUM_TOKENS)
    args = {"max_num_batched_tokens": 16, "multiprocess": multiprocess}
    with LLM(model=str(diverse_checkpoint), **args) as llm:
        assert generate(llm, [video_and_image.prompt]) == [expected]


def test_an_image_video_image_step_makes_two_vision_calls_and_matches_transformers(
    diverse_checkpoint, oracle
):
    case = build_case(
        oracle,
        chat(f"{IMG}then{VID}and{IMG}: which two match?"),
        [random_image(56, 84, seed=9), random_image(84, 56, seed=10)],
        [random_video(4, 112, 84, seed=11)],
        max_pixels=MAX_VIDEO_PIXELS,
    )
    expected = oracle_greedy(oracle, case, NUM_TOKENS)
    with LLM(model=str(diverse_checkpoint)) as llm:
        assert generate(llm, [case.prompt]) == [expected]
        snap = llm.engine.metrics.snapshot()
        manager = llm.engine.core.scheduler.encoder_cache_manager
        runner = llm.engine.core.executor.runner
        # the byte ledger counts exactly what the runner's cache holds
        assert manager.num_used_bytes == runner.encoder_cache.num_bytes > 0
    assert snap.counters["encoder_forward_calls"] == 2  # one per modality, not three
    assert snap.modality_counters["encoder_forward_calls"] == {"image": 1, "video": 1}
    assert snap.modality_counters["encoder_items_encoded"] == {"image": 2, "video": 1}
