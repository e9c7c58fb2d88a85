"""Pixels wait on the executor side until a request's prefill has passed them, then stay
bounded for a re-encode; a preemption gets them back."""

from __future__ import annotations

from pathlib import Path

from mmserve import LLM, SamplingParams
from tests.support.factory import random_image
from tests.support.faults import assert_nothing_held, run_all

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Images of 16 tokens and an encoder cache of the minimum (the largest item at max_pixels, 56
# tokens): a request's second image evicts its first, so a resumed request encodes it again.
# The cache is floored at the largest item a request may send: no videos, so that is an image.
SMALL_ENCODER_CACHE = {
    "mm_processor_kwargs": {"max_pixels": 112 * 112},
    "encoder_cache_size": 1,
    "limit_mm_per_prompt": {"video": 0},
}
# 6 requests of ~70 tokens need ~105 blocks of 4: 60 forces preemptions; without the prefix
# cache a resumed request recomputes its prompt.
TIGHT = {"block_size": 4, "num_gpu_blocks_override": 60, "enable_prefix_caching": False}


def _image_request(seed: int) -> dict:
    images = [random_image(112, 112, seed=seed), random_image(112, 112, seed=100 + seed)]
    return {"prompt": f"{IMG} and {IMG}: what differs?", "multi_modal_data": {"image": images}}


def test_a_decoding_request_holds_no_pixels(diverse_checkpoint: Path) -> None:
    llm = LLM(model=str(diverse_checkpoint))
    engine = llm.engine
    engine.add_request(
        "r", engine.input_processor.process_generate_input(_image_request(1)), GREEDY
    )
    while not engine.step():  # until the prefill is done and the first token is out
        pass
    request = engine.core.scheduler.requests["r"]
    store = engine.core.executor.runner.item_data
    # neither the scheduler's request nor the runner's state holds pixels: only specs, and
    # the executor side's store no longer holds them for "r" as waiting for the encoder
    assert not any(store.is_pending(f.identifier, "r") for f in request.mm_features)
    assert store.num_pending == 0
    assert request.mm_features[0].identifier in store
    run_all(engine)
    assert len(store) == 0 and store.used_bytes == 0  # gone with the request
    assert_nothing_held(engine)


def test_preempted_requests_encode_again_from_the_store_to_the_same_answer(
    diverse_checkpoint: Path,
) -> None:
    requests = [_image_request(s) for s in range(6)]
    roomy = LLM(model=str(diverse_checkpoint), block_size=4, **SMALL_ENCODER_CACHE)
    expected = [o.outputs[0].token_ids for o in roomy.generate(requests, GREEDY)]
    tight = LLM(model=str(diverse_checkpoint), **TIGHT, **SMALL_ENCODER_CACHE)
    got = [o.outputs[0].token_ids for o in tight.generate(requests, GREEDY)]
    assert got == expected
    store = tight.engine.core.executor.runner.item_data
    assert store.num_restored > 0  # the path under test ran
    assert len(store) == 0 and store.num_pending == 0
    assert_nothing_held(tight.engine)


def test_without_a_store_a_preempted_request_that_needs_its_image_fails_alone(
    diverse_checkpoint: Path,
) -> None:
    requests = [_image_request(s) for s in range(6)]
    tight = LLM(
        model=str(diverse_checkpoint), mm_reencode_cache_gb=0, **TIGHT, **SMALL_ENCODER_CACHE
    )
    outs = tight.generate(requests, GREEDY)
    failed = [o for o in outs if o.outputs[0].finish_reason == "error"]
    assert failed, "no resumed request needed its image again: the test proves nothing"
    assert all("no longer holds the pixels" in o.error for o in failed)
    assert any(o.outputs[0].finish_reason == "length" for o in outs)
    assert_nothing_held(tight.engine)
