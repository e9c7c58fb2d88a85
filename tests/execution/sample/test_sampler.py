"""Sampler: greedy, top-k/top-p, min_tokens, batch-independent seeds, rows that fail alone."""

from __future__ import annotations

import msgspec
import pytest
import torch

from mmserve.errors import FailureKind, InvalidRequestError, RequestFailure
from mmserve.execution.sample.rows import SamplingRow
from mmserve.execution.sample.sampler import make_device_generator, sample
from mmserve.sampling_params import SamplingParams


def _row(params: SamplingParams, num_out: int = 0, request_id: str = "r") -> SamplingRow:
    return SamplingRow(request_id, params, num_out, eos_token_ids=(0,))


def test_greedy_picks_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 2.0]])
    assert sample(
        logits, [_row(SamplingParams(temperature=0))] * 2, make_device_generator(0, "cpu")
    ) == [1, 0]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[9.0, 1.0, 8.0, 0.0]])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,))
    assert sample(logits.clone(), [_row(p, num_out=0)], make_device_generator(0, "cpu")) == [1]
    assert sample(logits.clone(), [_row(p, num_out=2)], make_device_generator(0, "cpu")) == [0]


def test_top_k_one_is_greedy_and_top_p_keeps_the_head():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    best = int(logits.argmax())
    for seed in range(20):
        p = SamplingParams(temperature=1.0, top_k=1, seed=seed)
        assert sample(logits, [_row(p)], make_device_generator(0, "cpu")) == [best]
        p = SamplingParams(temperature=1.0, top_p=1e-6, seed=seed)
        assert sample(logits, [_row(p)], make_device_generator(0, "cpu")) == [best]


def test_top_k_restricts_support():
    logits = torch.arange(10, dtype=torch.float32)[None]
    seen = set()
    gen = make_device_generator(1, "cpu")
    for _ in range(200):
        seen.update(sample(logits, [_row(SamplingParams(temperature=5.0, top_k=3))], gen))
    assert seen == {7, 8, 9}


def test_seeded_request_is_reproducible_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draws(batch_rows):
        gen = make_device_generator(99, "cpu")
        picks = []
        for position in range(10):
            rows = [_row(seeded, num_out=position)] + batch_rows
            picks.append(sample(logits[: len(rows)], rows, gen)[0])
        return picks

    alone = draws([])
    crowded = draws([_row(SamplingParams(temperature=1.0)) for _ in range(3)])
    assert alone == crowded
    assert len(set(alone)) > 1  # it really samples


def test_a_seeded_draw_depends_on_seed_and_position_only():
    # no random state: the same (seed, position) draws the same token at any time, in any
    # order, whatever the engine's generator (so preemption and processes cannot change it)
    torch.manual_seed(0)
    logits = torch.randn(1, 100)
    seeded = SamplingParams(temperature=1.0, seed=-5)
    forward = [
        sample(logits, [_row(seeded, num_out=i)], make_device_generator(1, "cpu"))[0]
        for i in range(12)
    ]
    backward = [
        sample(logits, [_row(seeded, num_out=i)], make_device_generator(2, "cpu"))[0]
        for i in reversed(range(12))
    ]
    assert forward == backward[::-1]
    assert len(set(forward)) > 1
    other = SamplingParams(temperature=1.0, seed=-4)
    assert forward != [
        sample(logits, [_row(other, num_out=i)], make_device_generator(1, "cpu"))[0]
        for i in range(12)
    ]


def _bypassing(params: SamplingParams, **fields) -> SamplingParams:
    """`params` with values __post_init__ would refuse, as if they slipped past the edge."""
    copy = msgspec.structs.replace(params)
    for name, value in fields.items():
        msgspec.structs.force_setattr(copy, name, value)
    return copy


BAD_VALUES = [
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", -0.5),
    ("temperature", "1"),
    ("top_p", float("nan")),
    ("top_p", 0.0),
    ("top_k", 2.5),
    ("top_k", -7),
    ("min_tokens", "2"),
    ("stop_token_ids", ("x",)),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_a_bad_value_fails_only_its_row(field: str, value: object) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 64)
    good = [
        _row(SamplingParams(temperature=0)),
        _row(SamplingParams(temperature=0.8, seed=3)),
        _row(SamplingParams(temperature=1.0, top_k=5, seed=4, min_tokens=2), num_out=1),
    ]
    bad = _row(_bypassing(SamplingParams(temperature=1.0, seed=5, min_tokens=1), **{field: value}))
    alone = sample(logits[[0, 1, 3]].clone(), _fresh(good), make_device_generator(0, "cpu"))
    mixed = sample(
        logits.clone(), [*_fresh(good[:2]), bad, *_fresh(good[2:])], make_device_generator(0, "cpu")
    )
    failure = mixed.pop(2)
    assert isinstance(failure, RequestFailure), failure
    assert failure.kind is FailureKind.REQUEST and failure.param == field
    assert mixed == alone


def _fresh(rows: list[SamplingRow]) -> list[SamplingRow]:
    """The same rows again (a seeded row's draw depends only on its seed and position)."""
    return [_row(r.params, r.num_output_tokens) for r in rows]


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_non_finite_logits_fail_only_their_row(bad_value: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 64)
    rows = [
        _row(SamplingParams(temperature=0)),
        _row(SamplingParams(temperature=0)),
        _row(SamplingParams(temperature=1.0, seed=9)),
        _row(SamplingParams(temperature=1.0, seed=10)),
    ]
    clean = sample(logits.clone(), _fresh(rows), make_device_generator(0, "cpu"))
    broken = logits.clone()
    broken[1, 7] = bad_value  # a greedy row
    broken[3, 0] = bad_value  # a sampled row
    got = sample(broken, _fresh(rows), make_device_generator(0, "cpu"))
    for i in (1, 3):
        assert isinstance(got[i], RequestFailure) and got[i].kind is FailureKind.INTERNAL
    assert [got[0], got[2]] == [clean[0], clean[2]]


def test_a_tiny_temperature_picks_the_best_token() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 64)
    best = int(logits.argmax())
    for temperature in (1e-300, 5e-324, 1e-40):
        for seed in range(5):
            params = SamplingParams(temperature=temperature, seed=seed, top_p=0.5)
            assert sample(logits.clone(), [_row(params)], make_device_generator(0, "cpu")) == [best]


def test_seeds_torch_cannot_take_are_a_typed_error_naming_seed() -> None:
    assert make_device_generator(2**64 - 1, "cpu").initial_seed() == 2**64 - 1
    make_device_generator(-(2**63), "cpu")
    logits = torch.zeros(1, 8)
    for seed in (2**64, -(2**63) - 1, 10**5000, 1.5, True, "7"):
        with pytest.raises(InvalidRequestError) as refused:
            make_device_generator(seed, "cpu")  # type: ignore[arg-type]
        assert refused.value.param == "seed"
        assert len(refused.value.message) < 120
        # a row whose seed slipped past validation fails alone, naming seed
        row = _row(_bypassing(SamplingParams(temperature=1.0), seed=seed))
        (failure,) = sample(logits.clone(), [row], make_device_generator(0, "cpu"))
        assert isinstance(failure, RequestFailure) and failure.kind is FailureKind.REQUEST
        assert failure.param == "seed" and len(failure.message) < 120


def test_minus_inf_logits_only_rule_their_token_out() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 16)
    best = int(logits[0].argmax())
    logits[0, best] = float("-inf")
    logits[1, :8] = float("-inf")
    rows = [_row(SamplingParams(temperature=0)), _row(SamplingParams(temperature=1.0, seed=1))]
    gen = make_device_generator(0, "cpu")
    for _ in range(50):
        greedy, drawn = sample(logits.clone(), rows, gen)
        assert greedy == int(logits[0].argmax()) != best
        assert 8 <= drawn < 16


def test_unseeded_rows_of_equal_params_draw_together_from_each_rows_own_distribution():
    # every row's mass sits on a different token: a batched draw that mixed rows up would show
    vocab, num_rows = 40, 12
    logits = torch.full((num_rows, vocab), -30.0)
    for i in range(num_rows):
        logits[i, (3 * i) % vocab] = 10.0
        logits[i, (3 * i + 1) % vocab] = 9.5
    p = SamplingParams(temperature=0.7, top_k=2, top_p=0.99)
    rows = [_row(p, request_id=f"r{i}") for i in range(num_rows)]
    for draw in range(10):
        out = sample(logits.clone(), rows, make_device_generator(draw, "cpu"))
        for i, token in enumerate(out):
            assert token in ((3 * i) % vocab, (3 * i + 1) % vocab), (i, token)
    # top_p cuts the runner-up once it is below the mass already kept
    narrow = SamplingParams(temperature=0.7, top_p=0.5)
    out = sample(logits.clone(), [_row(narrow)] * num_rows, make_device_generator(0, "cpu"))
    assert out == [(3 * i) % vocab for i in range(num_rows)]


def test_a_broken_row_in_a_shared_draw_fails_alone():
    logits = torch.zeros(4, 10)
    logits[2, 3] = float("nan")
    p = SamplingParams(temperature=1.0)
    out = sample(
        logits, [_row(p, request_id=f"r{i}") for i in range(4)], make_device_generator(0, "cpu")
    )
    assert isinstance(out[2], RequestFailure) and out[2].kind is FailureKind.INTERNAL
    assert all(isinstance(t, int) and 0 <= t < 10 for k, t in enumerate(out) if k != 2)
