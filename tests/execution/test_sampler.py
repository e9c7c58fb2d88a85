"""Sampler: greedy, top-k/top-p support, min_tokens, and seeds that do not depend on the batch."""

from __future__ import annotations

import torch

from mmserve.execution.sampler import SamplingRow, make_generator, sample
from mmserve.sampling_params import SamplingParams


def _row(params: SamplingParams, num_out: int = 0) -> SamplingRow:
    gen = make_generator(params.seed) if params.seed is not None else None
    return SamplingRow(params, gen, num_out, eos_token_ids=(0,))


def test_greedy_picks_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 2.0]])
    assert sample(logits, [_row(SamplingParams(temperature=0))] * 2, make_generator(0)) == [1, 0]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[9.0, 1.0, 8.0, 0.0]])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,))
    assert sample(logits.clone(), [_row(p, num_out=0)], make_generator(0)) == [1]
    assert sample(logits.clone(), [_row(p, num_out=2)], make_generator(0)) == [0]


def test_top_k_one_is_greedy_and_top_p_keeps_the_head():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    best = int(logits.argmax())
    for seed in range(20):
        p = SamplingParams(temperature=1.0, top_k=1, seed=seed)
        assert sample(logits, [_row(p)], make_generator(0)) == [best]
        p = SamplingParams(temperature=1.0, top_p=1e-6, seed=seed)
        assert sample(logits, [_row(p)], make_generator(0)) == [best]


def test_top_k_restricts_support():
    logits = torch.arange(10, dtype=torch.float32)[None]
    seen = set()
    gen = make_generator(1)
    for _ in range(200):
        seen.update(sample(logits, [_row(SamplingParams(temperature=5.0, top_k=3))], gen))
    assert seen == {7, 8, 9}


def test_seeded_request_is_reproducible_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draws(batch_rows):
        rows = [_row(seeded)] + batch_rows
        gen = make_generator(99)
        picks = []
        for _ in range(10):
            picks.append(sample(logits[: len(rows)], rows, gen)[0])
        return picks

    alone = draws([])
    crowded = draws([_row(SamplingParams(temperature=1.0)) for _ in range(3)])
    assert alone == crowded
    assert len(set(alone)) > 1  # it really samples
