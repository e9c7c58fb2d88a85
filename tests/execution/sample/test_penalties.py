"""Penalties and logit_bias against the direct formulas, on hand-made logits."""

from __future__ import annotations

import torch

from mmserve.errors import FailureKind
from mmserve.execution.sample.penalties import apply_penalties, token_counts
from mmserve.execution.sample.rows import SamplingRow
from mmserve.execution.sample.sampler import make_device_generator, sample
from mmserve.sampling_params import SamplingParams

VOCAB = 8


def _row(params: SamplingParams, prompt: list[int], output: list[int]) -> SamplingRow:
    return SamplingRow("r", params, len(output), (0,), prompt + output)


def _logits(seed: int, num_rows: int = 1) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_token_counts_count_each_occurrence_and_ignore_padding() -> None:
    counts = token_counts([[1, 1, 3], [], [7]], VOCAB, torch.device("cpu"))
    expected = torch.zeros(3, VOCAB)
    expected[0, 1], expected[0, 3], expected[2, 7] = 2, 1, 1
    assert torch.equal(counts, expected)


def test_frequency_and_presence_penalties_follow_the_formula() -> None:
    prompt, output = [2, 5], [1, 1, 3, 1]
    params = SamplingParams(frequency_penalty=0.7, presence_penalty=-1.5)
    logits = _logits(0)
    expected = logits.clone()
    for token in set(output):
        count = output.count(token)
        expected[0, token] -= 0.7 * count + (-1.5) * 1
    assert apply_penalties(logits, [_row(params, prompt, output)]) == {}
    torch.testing.assert_close(logits, expected)  # prompt tokens 2 and 5 untouched


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    prompt, output = [2, 4], [6]
    logits = torch.tensor([[1.0, -1.0, 3.0, 0.5, -2.0, 4.0, 0.0, -0.5]])
    expected = logits.clone()
    for token in (2, 4, 6):  # prompt and output alike
        value = expected[0, token]
        expected[0, token] = value / 2.0 if value > 0 else value * 2.0
    apply_penalties(logits, [_row(SamplingParams(repetition_penalty=2.0), prompt, output)])
    torch.testing.assert_close(logits, expected)


def test_logit_bias_adds_to_the_named_tokens_and_rows_stay_independent() -> None:
    plain = SamplingParams()
    biased = SamplingParams(logit_bias={3: 5.0, 7: -100.0})
    penalized = SamplingParams(frequency_penalty=1.0, logit_bias={0: 1.0})
    rows = [_row(plain, [1], [1]), _row(biased, [1], [3]), _row(penalized, [], [4, 4])]
    logits = _logits(1, 3)
    expected = logits.clone()
    expected[1, 3] += 5.0
    expected[1, 7] -= 100.0
    expected[2, 0] += 1.0
    expected[2, 4] -= 2.0
    assert apply_penalties(logits, rows) == {}
    torch.testing.assert_close(logits, expected)


def test_a_bias_outside_the_vocabulary_fails_its_row_only() -> None:
    rows = [
        _row(SamplingParams(logit_bias={VOCAB: 1.0}), [], []),
        _row(SamplingParams(temperature=0, logit_bias={2: 100.0}), [], []),
    ]
    logits = _logits(2, 2)
    out = sample(logits, rows, make_device_generator(0, "cpu"))
    assert out[0].kind is FailureKind.REQUEST and out[0].param == "logit_bias"
    assert out[1] == 2


def test_a_strong_bias_forces_the_token_greedy_and_sampled() -> None:
    logits = _logits(3, 2)
    forced = [
        _row(SamplingParams(temperature=0, logit_bias={5: 100.0}), [], []),
        _row(SamplingParams(temperature=1.0, seed=1, logit_bias={5: 100.0}), [], []),
    ]
    assert sample(logits, forced, make_device_generator(0, "cpu")) == [5, 5]


def test_rows_without_penalties_are_left_alone() -> None:
    logits = _logits(4, 2)
    before = logits.clone()
    rows = [_row(SamplingParams(), [1, 2], [3]), _row(SamplingParams(temperature=0), [], [])]
    assert apply_penalties(logits, rows) == {}
    assert torch.equal(logits, before)


def test_extreme_repetition_penalties_keep_the_row_sampleable() -> None:
    logits = torch.tensor([[1.0, -1.0, 3.0, 0.0, 2.0, 0.5, -2.0, 1.5]])
    for penalty in (5e-324, 1e-300, 1e300):
        rows = [_row(SamplingParams(temperature=0, repetition_penalty=penalty), [2, 1], [])]
        (token,) = sample(logits.clone(), rows, make_device_generator(0, "cpu"))
        # a tiny penalty makes seen token 2 the (finite) best; a huge one buries it
        assert token == (2 if penalty < 1 else 4)
