"""Greedy output of the whole engine equals transformers' `generate`, in every batching mode."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from tests.support.factory import random_image
from tests.support.parity_cases import CASES, IMG, _request, chat

NUM_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture
def expected(oracle) -> dict[str, list[int]]:
    return {name: oracle.greedy(p, imgs, NUM_TOKENS) for name, (p, imgs) in CASES.items()}


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 32},  # prefill chunks cut through the images
        {"max_num_batched_tokens": 32, "enable_prefix_caching": False, "block_size": 4},
        {"multiprocess": True},  # the engine core in its own process, as the server runs it
        {"multiprocess": True, "max_num_batched_tokens": 32},
    ],
    ids=["default", "chunked", "chunked_no_prefix_small_blocks", "multiprocess", "mp_chunked"],
)
def test_each_request_alone_and_all_in_one_batch_match_transformers(
    diverse_checkpoint, expected, engine_args
):
    with LLM(model=str(diverse_checkpoint), **engine_args) as llm:
        for name, (prompt, images) in CASES.items():
            out = llm.generate(_request(prompt, images), GREEDY)[0]
            assert out.outputs[0].token_ids == expected[name], name
        batch = llm.generate([_request(p, imgs) for p, imgs in CASES.values()], GREEDY)
        assert [o.outputs[0].token_ids for o in batch] == list(expected.values())


def test_prefix_cache_never_mixes_pictures(diverse_checkpoint, oracle):
    """Requests sharing a long prefix, carrying different same-sized images, one after another;
    then the same image behind a prompt one token longer. Every answer matches transformers."""
    llm = LLM(model=str(diverse_checkpoint), block_size=4)
    system = "You are a careful assistant who looks at pictures. " * 3
    images = [random_image(56, 56, seed=s) for s in (10, 11, 12)]
    prompts = [chat(f"{system}{IMG}What is it?") for _ in images]
    prompts.append(chat(f"{system}x{IMG}What is it?"))  # one token longer before the image
    images.append(images[0])
    answers = []
    for prompt, image in zip(prompts, images, strict=True):
        got = llm.generate(_request(prompt, [image]), GREEDY)[0].outputs[0].token_ids
        assert got == oracle.greedy(prompt, [image], NUM_TOKENS)
        answers.append(got)
    assert len({tuple(a) for a in answers}) > 1  # the pictures really change the answer
    counters = llm.engine.metrics.snapshot().counters
    assert counters["prefix_cache_hits"] > 0  # the shared prefix was reused


def test_same_prompt_twice_hits_the_caches_and_answers_the_same(diverse_checkpoint, expected):
    llm = LLM(model=str(diverse_checkpoint))
    prompt, images = CASES["two_images"]
    first = llm.generate(_request(prompt, images), GREEDY)[0]
    second = llm.generate(_request(prompt, images), GREEDY)[0]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == expected["two_images"]
    counters = llm.engine.metrics.snapshot().counters
    assert counters["encoder_items_encoded"] == 2  # the second request re-encoded nothing
    assert counters["prefix_cache_hits"] >= len(first.prompt_token_ids) - 16


def test_the_oracles_teacher_forced_logits_pick_its_own_greedy_tokens(oracle):
    """`HFOracle.next_logits` (the GPU suite's divergence margins) sees the same context as its
    greedy generation: teacher-forced on the first k tokens, its argmax is token k."""
    prompt = chat(f"{IMG}Describe it.")
    images = [random_image(56, 84, seed=4)]
    tokens = oracle.greedy(prompt, images, 4)
    for k in (0, 3):
        assert int(oracle.next_logits(prompt, images, tokens[:k]).argmax()) == tokens[k]
