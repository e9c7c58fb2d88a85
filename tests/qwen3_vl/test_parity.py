"""Qwen3-VL through the whole engine (offline `LLM`) equals transformers' greedy `generate` and
its log-softmax, float32: text only, images of sizes other than the 4x4 position table, a tall
thin image, a batch, chunked prefill cutting through images, prefix-cache hits, many images
under a small encoder budget."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from tests.support.factory import random_image
from tests.support.parity_cases import CASES, IMG, _request, chat

NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)

QWEN3_CASES = {
    **CASES,
    # 40 x 400 pixels: a grid of 2 x 12 patches, 12 times taller than wide
    "tall_thin": (chat(f"{IMG}Is it tall?"), [random_image(40, 400, seed=4)]),
    "wide_and_square": (
        chat(f"Two:{IMG} and{IMG}."),
        [random_image(200, 33, seed=5), random_image(128, 128, seed=6)],
    ),
}


@pytest.fixture(scope="module")
def expected(qwen3_oracle) -> dict[str, list[int]]:
    return {
        name: qwen3_oracle.greedy(prompt, images, NUM_TOKENS)
        for name, (prompt, images) in QWEN3_CASES.items()
    }


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        # chunks of 16 tokens cut through every image; DeepStack rows follow their chunk
        {"max_num_batched_tokens": 16, "block_size": 4},
    ],
    ids=["default", "chunked"],
)
def test_each_request_alone_and_all_in_one_batch_match_transformers(
    qwen3_vl_dir, expected, engine_args
):
    with LLM(model=str(qwen3_vl_dir), **engine_args) as llm:
        for name, (prompt, images) in QWEN3_CASES.items():
            out = llm.generate(_request(prompt, images), GREEDY)[0]
            assert out.outputs[0].token_ids == expected[name], name
        batch = llm.generate([_request(p, imgs) for p, imgs in QWEN3_CASES.values()], GREEDY)
        assert [o.outputs[0].token_ids for o in batch] == list(expected.values())
    answers = {tuple(tokens) for tokens in expected.values()}
    assert len(answers) == len(expected)  # every picture changes the answer: the test can fail


def test_a_prefix_cache_hit_answers_as_a_miss(qwen3_vl_dir, qwen3_oracle):
    """The same image behind a shared prefix, twice (the second request's image blocks come
    from the prefix cache), then a different image: all equal transformers."""
    system = "You are a careful assistant who looks at pictures. " * 2
    prompt = chat(f"{system}{IMG}What is it?")
    first, other = random_image(96, 64, seed=7), random_image(96, 64, seed=8)
    with LLM(model=str(qwen3_vl_dir), block_size=4) as llm:
        miss = llm.generate(_request(prompt, [first]), GREEDY)[0]
        hit = llm.generate(_request(prompt, [first]), GREEDY)[0]
        counters = llm.engine.metrics.snapshot().counters
        assert counters["prefix_cache_hits"] >= len(miss.prompt_token_ids) - 4
        changed = llm.generate(_request(prompt, [other]), GREEDY)[0]
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    assert miss.outputs[0].token_ids == qwen3_oracle.greedy(prompt, [first], NUM_TOKENS)
    assert changed.outputs[0].token_ids == qwen3_oracle.greedy(prompt, [other], NUM_TOKENS)


def test_many_images_under_a_small_encoder_budget(qwen3_vl_dir, qwen3_oracle):
    """Six images of 80 to 100 tokens, an encoder cache floored at the largest item (no two
    images fit it at once) and 32 tokens a step: items wait for budget and space, are encoded
    one at a time, chunks slice them; answers unchanged."""
    sizes = [(320, 256), (320, 288), (288, 320), (320, 320), (256, 320), (300, 300)]
    images = [random_image(w, h, seed=20 + i) for i, (w, h) in enumerate(sizes)]
    prompt = chat("Look:" + "".join(f"{IMG}{i}" for i in range(len(images))))
    args = {
        "max_num_batched_tokens": 32,
        "encoder_cache_size": 16,  # floored at the largest item the server accepts
        "mm_processor_kwargs": {"max_pixels": 320 * 320},
        "limit_mm_per_prompt": {"image": 6, "video": 0},  # the floor: the largest image
    }
    with LLM(model=str(qwen3_vl_dir), **args) as llm:
        assert llm.config.encoder_cache_slots < 2 * 80, "two images must not fit at once"
        outs = llm.generate([_request(prompt, images), _request(prompt, images[::-1])], GREEDY)
        counters = llm.engine.metrics.snapshot().counters
    assert outs[0].outputs[0].token_ids == qwen3_oracle.greedy(prompt, images, NUM_TOKENS)
    assert outs[1].outputs[0].token_ids == qwen3_oracle.greedy(prompt, images[::-1], NUM_TOKENS)
    assert counters["encoder_forward_calls"] >= len(images)  # never all at once


def _reference_logprobs(oracle, prompt: str, images: list, generated: list[int]) -> torch.Tensor:
    """[len(generated), vocab]: transformers' log-softmax at each generated position."""
    inputs = oracle.inputs(prompt, images)
    num_prompt = inputs["input_ids"].shape[1]
    ids = torch.cat([inputs["input_ids"], torch.tensor([generated])], dim=1)
    inputs.update(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == oracle.image_token_id).long(),
    )
    with torch.no_grad():
        logits = oracle.model(**inputs).logits[0]  # [num_tokens, vocab]
    steps = logits[num_prompt - 1 : num_prompt - 1 + len(generated)]
    return torch.log_softmax(steps.float(), dim=-1)


@pytest.mark.parametrize("case", ["text_only", "two_images", "tall_thin"])
def test_top_logprobs_match_transformers(qwen3_vl_dir, qwen3_oracle, case):
    prompt, images = QWEN3_CASES[case]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    with LLM(model=str(qwen3_vl_dir), max_num_batched_tokens=16) as llm:
        seq = llm.generate(_request(prompt, images), params)[0].outputs[0]
    reference = _reference_logprobs(qwen3_oracle, prompt, images, seq.token_ids)
    assert seq.logprobs is not None and len(seq.logprobs) == len(seq.token_ids)
    for step, entry in enumerate(seq.logprobs):
        top = torch.topk(reference[step], 5).indices.tolist()
        assert set(top) <= set(entry)
        for token_id, logprob in entry.items():
            assert abs(logprob.logprob - float(reference[step, token_id])) < 1e-4, (step, token_id)


def test_deepstack_rows_reach_prefill_steps_only_each_row_once(qwen3_vl_dir, monkeypatch):
    """Every step's decoder call is seen: text-only and decode steps get no DeepStack rows;
    the prefill chunks of an image request get, all together, each image token exactly once."""
    from mmserve.models.qwen3_lm import Qwen3Model

    calls: list[tuple[int, list[int] | None]] = []  # (step tokens, DeepStack token indices)
    original = Qwen3Model.forward

    def recording(self, inputs_embeds, positions, attn_metadata, kv_caches, deepstack=None):
        rows = None if deepstack is None else deepstack.index.tolist()
        calls.append((inputs_embeds.shape[0], rows))
        return original(self, inputs_embeds, positions, attn_metadata, kv_caches, deepstack)

    monkeypatch.setattr(Qwen3Model, "forward", recording)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompt, images = QWEN3_CASES["two_images"]
    with LLM(model=str(qwen3_vl_dir), max_num_batched_tokens=16) as llm:
        calls.clear()  # the start-up profile run
        llm.generate(QWEN3_CASES["text_only"][0], params)
        assert calls and all(rows is None for _, rows in calls)
        calls.clear()
        out = llm.generate(_request(prompt, images), params)[0]
    image_token_id = llm.engine.input_processor.token_ids.image_token_id
    num_image_tokens = out.prompt_token_ids.count(image_token_id)
    with_rows = [(n, rows) for n, rows in calls if rows is not None]
    assert len(with_rows) > 1  # the images were cut into several chunks
    assert sum(len(rows) for _, rows in with_rows) == num_image_tokens
    assert all(0 <= i < n for n, rows in with_rows for i in rows)
    assert calls[-2:] == [(1, None), (1, None)]  # the two decode steps: none


def test_unchunked_items_a_patch_budget_and_misses_batched_across_requests(qwen3_vl_dir, expected):
    """--disable-chunked-mm-input with a patch budget floored at the largest image (so a step's
    misses take several encoder calls), then the default budget, which encodes the images of
    several requests in one call: every answer of the batch still equals transformers'."""
    requests = [_request(p, imgs) for p, imgs in QWEN3_CASES.values()]
    num_images = sum(len(imgs) for _, imgs in QWEN3_CASES.values())
    bounded = {
        "mm_processor_kwargs": {"max_pixels": 128 * 128},  # the largest case image, unresized
        "limit_mm_per_prompt": {"image": 2, "video": 0},
    }
    unchunked = {"max_num_batched_tokens": 64, "disable_chunked_mm_input": True}
    with LLM(model=str(qwen3_vl_dir), encoder_patch_budget=1, **unchunked, **bounded) as llm:
        batch = llm.generate(requests, GREEDY)
        one_at_a_time = llm.engine.metrics.snapshot().counters["encoder_forward_calls"]
    assert [o.outputs[0].token_ids for o in batch] == list(expected.values())
    with LLM(model=str(qwen3_vl_dir), **bounded) as llm:
        batch = llm.generate(requests, GREEDY)
        together = llm.engine.metrics.snapshot().counters["encoder_forward_calls"]
    assert [o.outputs[0].token_ids for o in batch] == list(expected.values())
    # the budget splits the step's misses into several calls; without it, one call takes the
    # images of several requests
    assert together < one_at_a_time and together < num_images, (together, one_at_a_time)
