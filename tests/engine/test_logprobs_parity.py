"""Logprobs equal the log-softmax of transformers' logits (float32, tiny random checkpoints)."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from tests.support.parity_cases import CASES, _request

NUM_TOKENS = 6
NUM_TOP = 5


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


@pytest.mark.parametrize(
    "engine_args", [{}, {"multiprocess": True}], ids=["in_process", "multiprocess"]
)
def test_logprobs_match_transformers_whatever_the_sampling(
    diverse_checkpoint, oracle, engine_args
) -> None:
    # Penalties, a bias and a temperature change what is sampled, never the values reported:
    # those are the raw logits' (vLLM's default).
    sampled = SamplingParams(
        temperature=0.8,
        seed=7,
        max_tokens=NUM_TOKENS,
        ignore_eos=True,
        logprobs=NUM_TOP,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        logit_bias={11: 3.0},
    )
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    prompt, images = CASES["one_image"]
    with LLM(model=str(diverse_checkpoint), **engine_args) as llm:
        outputs = llm.generate([_request(prompt, images)] * 2, [sampled, greedy])
    for out, k in zip(outputs, (NUM_TOP, 0), strict=True):
        seq = out.outputs[0]
        assert seq.logprobs is not None and len(seq.logprobs) == NUM_TOKENS
        reference = _reference_logprobs(oracle, prompt, images, seq.token_ids)
        total = 0.0
        for step, (token_id, entry) in enumerate(zip(seq.token_ids, seq.logprobs, strict=True)):
            ids = list(entry)
            expected_top = torch.topk(reference[step], k).indices.tolist()
            assert ids[0] == token_id and set(expected_top) <= set(ids)
            assert len(ids) in (k, k + 1)
            for tid, lp in entry.items():
                assert abs(lp.logprob - float(reference[step, tid])) < 1e-4, (step, tid)
                expected_rank = int((reference[step] > reference[step, tid]).sum()) + 1
                assert abs(lp.rank - expected_rank) <= 1  # ties within float noise
                assert lp.decoded_token == llm_decode(llm, tid)
            total += entry[token_id].logprob
        assert seq.cumulative_logprob == pytest.approx(total, abs=1e-5)


def llm_decode(llm: LLM, token_id: int) -> str:
    return llm.get_tokenizer().decode([token_id], skip_special_tokens=False)
