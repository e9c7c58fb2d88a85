"""SamplingParams: every field range-checked on entry, with an error that names the field."""

from __future__ import annotations

import logging

import pytest

from mmserve.errors import InvalidRequestError
from mmserve.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_STOP_STRINGS,
    MIN_SAMPLING_TEMPERATURE,
    SamplingParams,
)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": INT64_MAX + 1}, "seed"),
        ({"seed": INT64_MIN - 1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 1.0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 2**63, "max_tokens": None}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"n": True}, "n"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": [(5, 1.0)]}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x" * 1025]}, "stop"),
        ({"stop": [str(i) for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ],
)
def test_out_of_range_values_name_their_field(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in info.value.message


def test_limits_themselves_are_accepted() -> None:
    p = SamplingParams(
        seed=INT64_MIN, top_k=2**31 - 1, top_p=1, max_tokens=INT64_MAX, min_tokens=INT64_MAX
    )
    assert p.seed == INT64_MIN and p.effective_top_k == 2**31 - 1
    assert SamplingParams(seed=INT64_MAX, top_k=-1).effective_top_k == 0
    stops = SamplingParams(stop=["x" * 1024] * MAX_STOP_STRINGS, stop_token_ids=[0, 2**31 - 1])
    assert len(stops.stop) == MAX_STOP_STRINGS
    assert SamplingParams(stop="ab").stop == ("ab",)


def test_a_huge_integer_is_described_not_printed() -> None:
    # repr() of a 5000-digit int raises ValueError (Python's digit limit): the message must
    # still be built, and short.
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(seed=10**5000)
    assert info.value.param == "seed" and len(info.value.message) < 200


def test_zero_temperature_is_greedy_and_tiny_ones_are_clamped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=-0.0).is_greedy
    with caplog.at_level(logging.DEBUG, logger="mmserve.sampling_params"):
        tiny = SamplingParams(temperature=1e-300)
    assert tiny.temperature == MIN_SAMPLING_TEMPERATURE and not tiny.is_greedy
    assert len([r for r in caplog.records if "raised to" in r.getMessage()]) == 1
    assert SamplingParams(temperature=0.5).temperature == 0.5
    assert isinstance(SamplingParams(temperature=2).temperature, float)


def test_unknown_vllm_options_are_not_silently_accepted() -> None:
    # The offline API must not take an option it would ignore (vLLM has these).
    for name in ("best_of", "length_penalty", "use_beam_search"):
        with pytest.raises(TypeError):
            SamplingParams(**{name: 0.5})


def test_penalty_limits_are_accepted_and_no_op_values_mean_no_penalty() -> None:
    p = SamplingParams(
        n=128, logprobs=0, presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01
    )
    assert p.n == 128 and p.has_penalties and isinstance(p.presence_penalty, float)
    assert SamplingParams(logit_bias={0: -100, 2**31 - 1: 100}).has_penalties
    assert not SamplingParams(
        logit_bias={}, repetition_penalty=1, frequency_penalty=0
    ).has_penalties
