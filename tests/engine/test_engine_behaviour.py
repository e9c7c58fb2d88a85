"""Engine behaviour a user notices: failures stay with their request, seeds, stops, preemption."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from mmserve import LLM, SamplingParams
from mmserve.multimodal import PlaceholderRange
from tests.support.factory import random_image

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\n{IMG}What is in the image?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def llm(diverse_checkpoint) -> LLM:
    return LLM(model=str(diverse_checkpoint))


def _image_request(seed: int = 1) -> dict:
    return {"prompt": PROMPT, "multi_modal_data": {"image": random_image(56, 84, seed=seed)}}


def test_placeholder_count_mismatch_fails_only_that_request(llm):
    engine = llm.engine
    good = engine.input_processor.process_generate_input(_image_request(1))
    bad = engine.input_processor.process_generate_input(_image_request(2))
    feature = bad.mm_features[0]
    # One placeholder too many: the encoder returns `length` rows for `length + 1` slots.
    offset = feature.placeholder.offset
    ids = bad.prompt_token_ids
    ids = ids[:offset] + [ids[offset]] + ids[offset:]
    positions = bad.mrope_positions
    import numpy as np

    positions = np.concatenate([positions[:, : offset + 1], positions[:, offset:] + 1], axis=1)
    broken = msgspec.structs.replace(
        feature, placeholder=PlaceholderRange(offset, feature.placeholder.length + 1)
    )
    bad = dataclasses.replace(
        bad, prompt_token_ids=ids, mm_features=[broken], mrope_positions=positions
    )
    params = SamplingParams(temperature=0, max_tokens=4)
    engine.add_request("good", good, params)
    engine.add_request("bad", bad, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].outputs[0].finish_reason == "error"
    expected = f"Attempted to assign {feature.placeholder.length}"
    assert expected in finals["bad"].error
    assert f"to {feature.placeholder.length + 1} placeholders" in finals["bad"].error
    assert finals["good"].outputs[0].finish_reason == "length"
    assert len(finals["good"].outputs[0].token_ids) == 4
    stats = engine.core.scheduler.make_stats()
    assert stats.num_free_kv_blocks == engine.core.scheduler.cache_config.num_blocks
    assert stats.encoder_cache_used_slots == 0


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    alone = llm.generate(_image_request(1), seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 3
    crowd = llm.generate(
        [_image_request(1), _image_request(2), "hello", _image_request(3)], [seeded, *others]
    )
    assert crowd[0].outputs[0].token_ids == alone
    other_seed = msgspec.structs.replace(seeded, seed=8)
    assert llm.generate(_image_request(1), other_seed)[0].outputs[0].token_ids != alone


def test_stop_rules(llm):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    full = llm.generate(_image_request(1), greedy)[0].outputs[0]
    assert len(full.token_ids) == 16 and full.finish_reason == "length"
    # a stop token id ends generation at its first occurrence (and is kept in token_ids)
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = llm.generate(
        _image_request(1), msgspec.structs.replace(greedy, stop_token_ids=(stop_id,))
    )
    assert out[0].outputs[0].token_ids == full.token_ids[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    assert out[0].outputs[0].stop_reason == stop_id
    # min_tokens: the stop id cannot end it before min_tokens tokens exist
    later = msgspec.structs.replace(greedy, stop_token_ids=(stop_id,), min_tokens=first + 2)
    assert len(llm.generate(_image_request(1), later)[0].outputs[0].token_ids) > first + 1
    # a stop string cuts the text before it and finishes the request
    text = full.text
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    if needle.strip():
        out = llm.generate(_image_request(1), msgspec.structs.replace(greedy, stop=(needle,)))
        assert out[0].outputs[0].text == text[: text.index(needle)]
        assert out[0].outputs[0].finish_reason == "stop"


def test_preemption_recomputes_to_the_same_answer(diverse_checkpoint):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    requests = [_image_request(s) for s in range(6)]
    roomy = LLM(model=str(diverse_checkpoint), block_size=4)
    expected = [o.outputs[0].token_ids for o in roomy.generate(requests, greedy)]
    # 6 requests of ~50 tokens each need ~78 blocks of 4: 40 forces preemptions
    tight = LLM(model=str(diverse_checkpoint), block_size=4, num_gpu_blocks_override=40)
    got = [o.outputs[0].token_ids for o in tight.generate(requests, greedy)]
    assert got == expected
    stats = tight.engine.core.scheduler.make_stats()
    assert stats.num_free_kv_blocks == 40
    assert any(r for r in [tight.engine.metrics.snapshot().counters["requests_finished"] == 6])


def test_a_refused_request_in_a_batch_leaves_nothing_behind(diverse_checkpoint):
    from mmserve.errors import EncoderItemTooLargeError

    # The server-wide cap keeps items at 4 tokens, so the encoder cache holds few slots; one
    # request raises its own cap, and its item can never fit: refused when it is added. No
    # videos: the budgets' floors cover the largest item of every accepted modality.
    llm = LLM(
        model=str(diverse_checkpoint),
        mm_processor_kwargs={"max_pixels": 56 * 56},
        max_num_batched_tokens=16,
        limit_mm_per_prompt={"video": 0},
    )
    huge = {**_image_request(2), "multi_modal_data": {"image": random_image(448, 448)}}
    huge["mm_processor_kwargs"] = {"max_pixels": 448 * 448}
    with pytest.raises(EncoderItemTooLargeError):
        llm.generate([_image_request(1), huge], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    stats = llm.engine.core.scheduler.make_stats()
    assert stats.num_free_kv_blocks == llm.engine.core.scheduler.cache_config.num_blocks
    out = llm.generate(_image_request(1), SamplingParams(temperature=0, max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2
