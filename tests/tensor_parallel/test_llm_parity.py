"""TP=2 through the offline LLM: greedy tokens and top-k logprobs equal TP=1 and transformers
(float32), on every architecture, with images, chunked prefill, prefix caching and the encoder
cache on; the items split across ranks (--mm-encoder-tp-mode data) or every item encoded with
the sharded tower (weights) answer the same."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from tests.support.parity_cases import CASES, _request
from tests.tensor_parallel.conftest import ARCHITECTURES, SMALL_KV

NUM_TOKENS = 6
NUM_TOP = 3
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=NUM_TOP)
# prefill chunks of 32 tokens cut through the images; blocks of 16 are prefix-cached
ENGINE = {"max_num_batched_tokens": 32, "enable_prefix_caching": True, **SMALL_KV}


def _answers(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Every case in one batch, then the two-image case again (encoder and prefix cache hits)."""
    requests = [_request(p, imgs) for p, imgs in CASES.values()]
    requests.append(requests[-1])
    out = []
    for o in llm.generate(requests, GREEDY):
        seq = o.outputs[0]
        out.append((seq.token_ids, [{t: lp.logprob for t, lp in e.items()} for e in seq.logprobs]))
    return out


def _assert_same(got, expected) -> None:
    for (ids, lps), (ids_ref, lps_ref) in zip(got, expected, strict=True):
        assert ids == ids_ref
        for step, ref in zip(lps, lps_ref, strict=True):
            assert step.keys() == ref.keys()
            for token_id, value in step.items():
                assert value == pytest.approx(ref[token_id], abs=1e-4)


@pytest.fixture(scope="module")
def tp1_answers(tp_checkpoints):
    """Each architecture's TP=1 answers, computed once for the module."""
    answers = {}
    for arch, path in tp_checkpoints.items():
        with LLM(model=str(path), **ENGINE) as llm:
            answers[arch] = _answers(llm)
    return answers


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tp2_equals_tp1_and_transformers(arch, tp_checkpoints, tp_oracles, tp1_answers) -> None:
    with LLM(model=str(tp_checkpoints[arch]), tensor_parallel_size=2, **ENGINE) as llm:
        parallel = _answers(llm)
        counters = llm.engine.metrics.snapshot().counters
    _assert_same(parallel, tp1_answers[arch])
    oracle = tp_oracles[arch]
    for (ids, lps), (prompt, images) in zip(parallel, [*CASES.values()], strict=False):
        assert ids == oracle.greedy(prompt, images, NUM_TOKENS)
        reference = _reference_logprobs(oracle, prompt, images, ids)
        for step, entry in enumerate(lps):
            for token_id, value in entry.items():
                assert value == pytest.approx(float(reference[step, token_id]), abs=1e-4)
    assert counters["prefix_cache_hits"] > 0  # the repeated request read the prefix cache


def test_every_item_encoded_on_every_rank_equals_the_split(tp_checkpoints, tp1_answers) -> None:
    """weights mode (the sharded tower, every rank encodes every item) answers as data mode
    (items split across ranks by patch cost, embeddings gathered: the test above) and TP=1,
    on Qwen3-VL, whose DeepStack levels travel with the embeddings."""
    model = str(tp_checkpoints["qwen3_vl"])
    with LLM(model=model, tensor_parallel_size=2, mm_encoder_tp_mode="weights", **ENGINE) as llm:
        _assert_same(_answers(llm), tp1_answers["qwen3_vl"])


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
