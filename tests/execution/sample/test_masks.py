"""min_p, allowed_token_ids and bad_words in the sampler, on hand-made logits."""

from __future__ import annotations

import pytest
import torch

from mmserve.errors import FailureKind, InvalidRequestError, RequestFailure
from mmserve.execution.sample.masks import apply_token_masks, banned_tokens
from mmserve.execution.sample.rows import SamplingRow
from mmserve.execution.sample.sampler import make_device_generator, sample
from mmserve.sampling_params import SamplingParams

VOCAB = 16


def _row(params: SamplingParams, output: list[int], prompt: list[int] | None = None) -> SamplingRow:
    prompt = [1, 2] if prompt is None else prompt
    return SamplingRow("r", params, len(output), (0,), prompt + output)


def _logits(seed: int, num_rows: int = 1) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _draw(logits: torch.Tensor, rows: list[SamplingRow], seed: int = 0) -> list[int]:
    out = sample(logits.clone(), rows, make_device_generator(seed, "cpu"))
    assert not any(isinstance(t, RequestFailure) for t in out), out
    return out  # type: ignore[return-value]


def test_min_p_one_equals_greedy_whatever_the_temperature_and_seed() -> None:
    logits = _logits(0, 4)
    greedy = logits.argmax(dim=-1).tolist()
    for seed in range(20):
        rows = [_row(SamplingParams(temperature=2.0, min_p=1.0, seed=seed), []) for _ in range(4)]
        assert _draw(logits, rows, seed) == greedy


def test_min_p_keeps_exactly_the_tokens_above_its_share_of_the_top() -> None:
    # probabilities at temperature 1: 0.5, 0.3, 0.2 and nearly nothing elsewhere
    logits = torch.full((1, VOCAB), -1e4)
    logits[0, :3] = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    seen = set()
    for seed in range(300):
        # min_p 0.5: p >= 0.25 survives (tokens 0 and 1), token 2 (0.2) never drawn
        seen.add(_draw(logits, [_row(SamplingParams(min_p=0.5, seed=seed), [])])[0])
    assert seen == {0, 1}
    without = {_draw(logits, [_row(SamplingParams(seed=s), [])])[0] for s in range(300)}
    assert without == {0, 1, 2}  # the same seeds reach token 2 without min_p


def test_min_p_is_per_row() -> None:
    logits = torch.zeros(2, VOCAB)  # uniform: min_p 1 keeps every token of a flat row
    logits[1, 5] = 10.0
    firsts = set()
    for s in range(50):
        rows = [_row(SamplingParams(min_p=0.9, seed=s), []), _row(SamplingParams(seed=s), [])]
        firsts.add(_draw(logits, rows, s)[0])
    assert len(firsts) > 1  # a flat row keeps all its tokens under min_p
    masked = [_row(SamplingParams(min_p=0.1, seed=s), []) for s in range(50)]
    assert {_draw(logits[1:], [row])[0] for row in masked} == {5}


def test_allowed_token_ids_leave_only_those_tokens() -> None:
    allowed = (3, 9, 11)
    rows = [_row(SamplingParams(allowed_token_ids=allowed), []), _row(SamplingParams(), [])]
    logits = _logits(1, 2)
    original = logits.clone()
    assert apply_token_masks(logits, rows) == {}
    assert torch.equal(logits[1], original[1])  # the other row is untouched
    for t in range(VOCAB):
        expected = original[0, t] if t in allowed else float("-inf")
        assert logits[0, t] == expected
    for seed in range(30):
        random_row = _row(SamplingParams(allowed_token_ids=allowed, seed=seed), [])
        assert _draw(_logits(seed), [random_row], seed)[0] in allowed
    greedy = _row(SamplingParams(temperature=0.0, allowed_token_ids=allowed), [])
    best = max(allowed, key=lambda t: float(original[0, t]))
    assert _draw(original[:1], [greedy])[0] == best


def test_allowed_token_ids_outside_the_vocabulary_fail_that_row_only() -> None:
    rows = [_row(SamplingParams(allowed_token_ids=(VOCAB,)), []), _row(SamplingParams(), [])]
    failures = apply_token_masks(_logits(2, 2), rows)
    assert list(failures) == [0]
    assert failures[0].kind is FailureKind.REQUEST and failures[0].param == "allowed_token_ids"


def test_a_one_token_bad_word_is_always_banned() -> None:
    params = SamplingParams(temperature=0.0, bad_words_token_ids=((4,),))
    logits = _logits(3)
    logits[0, 4] = 100.0
    assert _draw(logits, [_row(params, [])])[0] != 4
    assert _draw(logits, [_row(SamplingParams(temperature=0.0), [])])[0] == 4


def test_a_multi_token_bad_word_bans_its_last_token_only_after_its_prefix() -> None:
    params = SamplingParams(bad_words_token_ids=((7, 8, 9),))
    assert banned_tokens(_row(params, [1, 7, 8]), VOCAB) == [9]
    assert banned_tokens(_row(params, [7, 8, 1]), VOCAB) == []
    assert banned_tokens(_row(params, [8]), VOCAB) == []  # 7 missing
    assert banned_tokens(_row(params, [7]), VOCAB) == []  # one token short
    # the prompt does not count: only what the model generated (vLLM's semantics)
    assert banned_tokens(_row(params, [], prompt=[7, 8]), VOCAB) == []
    logits = _logits(4)
    logits[0, 9] = 100.0
    greedy = SamplingParams(temperature=0.0, bad_words_token_ids=((7, 8, 9),))
    assert _draw(logits, [_row(greedy, [7, 8])])[0] != 9
    assert _draw(logits, [_row(greedy, [8, 7])])[0] == 9


def test_bad_words_and_allowed_ids_combine_per_row() -> None:
    params = SamplingParams(
        temperature=0.0, allowed_token_ids=(2, 3), bad_words_token_ids=((5, 3),)
    )
    logits = _logits(5)
    logits[0, 3] = 50.0
    logits[0, 2] = 40.0
    assert _draw(logits, [_row(params, [5])])[0] == 2  # 3 completes "5 3"
    assert _draw(logits, [_row(params, [6])])[0] == 3


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"allowed_token_ids": ()}, "allowed_token_ids"),
        ({"allowed_token_ids": (-1,)}, "allowed_token_ids"),
        ({"bad_words": ("",)}, "bad_words"),
        ({"bad_words": "word"}, "bad_words"),
        ({"bad_words": tuple(f"w{i}" for i in range(129))}, "bad_words"),
        ({"bad_words_token_ids": ((),)}, "bad_words"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
