"""Logprobs of sampled tokens: the raw logits' log-softmax, whatever sampling did to them."""

from __future__ import annotations

import torch

from mmserve.errors import RequestFailure
from mmserve.execution.sample.logprobs import gather_logprobs, raw_logprobs
from mmserve.execution.sample.rows import SamplingRow
from mmserve.execution.sample.sampler import make_device_generator, sample
from mmserve.sampling_params import SamplingParams

VOCAB = 50


def _row(params: SamplingParams, num_out: int = 0) -> SamplingRow:
    return SamplingRow("r", params, num_out, (0,), [1] * (3 + num_out))


def test_values_are_the_raw_log_softmax_with_the_chosen_token_and_its_rank() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    reference = torch.log_softmax(logits, dim=-1)
    rows = [
        _row(SamplingParams(temperature=0, logprobs=3, logit_bias={7: 100.0})),  # forced 7
        _row(SamplingParams()),  # no logprobs
        _row(SamplingParams(temperature=0.3, seed=4, logprobs=0, frequency_penalty=2.0), 2),
        _row(SamplingParams(temperature=0, logprobs=5, min_tokens=3)),  # EOS banned
    ]
    raw = raw_logprobs(logits, rows)
    tokens = sample(logits, rows, make_device_generator(0, "cpu"))
    out = gather_logprobs(raw, tokens)
    assert sorted(out) == [0, 2, 3]
    assert tokens[0] == 7
    for i, k in ((0, 3), (2, 0), (3, 5)):
        lp = out[i]
        assert lp.token_ids.shape == (1, 1 + k) and lp.token_ids[0, 0] == tokens[i]
        torch.testing.assert_close(
            torch.from_numpy(lp.logprobs[0]), reference[i, lp.token_ids[0].tolist()]
        )
        top = torch.topk(reference[i], k).indices.tolist()
        assert lp.token_ids[0, 1:].tolist() == top
        expected_rank = int((reference[i] > reference[i, tokens[i]]).sum()) + 1
        assert lp.ranks.tolist() == [expected_rank]
    assert out[0].ranks[0] > 1 or int(reference[0].argmax()) == 7  # bias not in the values


def test_no_row_asking_means_no_work_and_a_failed_row_gets_none() -> None:
    logits = torch.randn(2, VOCAB)
    assert raw_logprobs(logits, [_row(SamplingParams())] * 2) is None
    logits[1, 3] = float("nan")
    rows = [_row(SamplingParams(temperature=0, logprobs=1))] * 2
    raw = raw_logprobs(logits, rows)
    tokens = sample(logits, rows, make_device_generator(0, "cpu"))
    assert isinstance(tokens[1], RequestFailure)
    assert sorted(gather_logprobs(raw, tokens)) == [0]
