"""Prompt logprobs equal the log-softmax of transformers' logits over the prompt (float32)."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from tests.support.parity_cases import CASES, _request

NUM_TOP = 3


def _reference(oracle, prompt: str, images: list) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and [num_prompt - 1, vocab]: the log-softmax at positions 0..P-2."""
    inputs = oracle.inputs(prompt, images)
    with torch.no_grad():
        logits = oracle.model(**inputs).logits[0]  # [num_prompt, vocab]
    ids = inputs["input_ids"][0].tolist()
    return ids, torch.log_softmax(logits[:-1].float(), dim=-1)


def _check(out, ids: list[int], reference: torch.Tensor, k: int) -> None:
    assert out.prompt_token_ids == ids
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(ids) and entries[0] is None
    for p, entry in enumerate(entries[1:]):
        actual = ids[p + 1]
        assert list(entry)[0] == actual  # the prompt token first, then the top k
        expected_top = torch.topk(reference[p], k).indices.tolist()
        assert set(expected_top) <= set(entry) and len(entry) in (k, k + 1)
        for tid, lp in entry.items():
            assert abs(lp.logprob - float(reference[p, tid])) < 1e-4, (p, tid)
        expected_rank = int((reference[p] > reference[p, actual]).sum()) + 1
        assert abs(entry[actual].rank - expected_rank) <= 1  # ties within float noise


@pytest.mark.parametrize(
    "engine_args",
    [
        {"max_num_batched_tokens": 32, "block_size": 4},  # chunks cut through the image
        {"multiprocess": True},
    ],
    ids=["chunked_prefix_cached", "multiprocess"],
)
def test_prompt_logprobs_match_transformers(diverse_checkpoint, oracle, engine_args) -> None:
    prompt, images = CASES["one_image"]
    ids, reference = _reference(oracle, prompt, images)
    wanting = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=NUM_TOP)
    plain = SamplingParams(temperature=0, max_tokens=2)
    with LLM(model=str(diverse_checkpoint), **engine_args) as llm:
        # the first request fills the prefix cache; the second must not skip positions
        first = llm.generate([_request(prompt, images)], plain)[0]
        assert first.prompt_logprobs is None
        again = llm.generate([_request(prompt, images)], wanting)[0]
        _check(again, ids, reference, NUM_TOP)
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        zero = llm.generate(
            [_request(prompt, images)], SamplingParams(max_tokens=1, prompt_logprobs=0)
        )
        _check(zero[0], ids, reference, 0)


def test_prompt_logprobs_of_a_text_prompt_and_n_samples(diverse_checkpoint, oracle) -> None:
    prompt, images = CASES["text_only"]
    ids, reference = _reference(oracle, prompt, images)
    params = SamplingParams(n=3, seed=1, max_tokens=3, prompt_logprobs=2)
    with LLM(model=str(diverse_checkpoint)) as llm:
        out = llm.generate([prompt], params)[0]
    assert len(out.outputs) == 3
    _check(out, ids, reference, 2)
