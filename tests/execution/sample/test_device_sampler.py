"""The device sampler: nothing read back before the one copy, draws that follow each row's
distribution, seeded noise that is a pure function of the row's keys, per-row parameters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.execution.sample.logprobs import gather_logprobs, logprob_table, raw_logprobs
from mmserve.execution.sample.noise import exponential_noise, hashed_noise, hashed_uniform
from mmserve.execution.sample.rows import SamplingRow
from mmserve.execution.sample.sampler import make_device_generator, sample, sample_on_device
from mmserve.execution.sample.step import sample_step
from mmserve.sampling_params import SamplingParams


def _row(params: SamplingParams, num_out: int = 0, token_ids=(1, 2, 2)) -> SamplingRow:
    return SamplingRow("r", params, num_out, (0,), token_ids)


EVERY_FEATURE = [
    SamplingParams(temperature=0, logprobs=2),
    SamplingParams(temperature=0.7, top_k=3, top_p=0.9, repetition_penalty=1.2),
    SamplingParams(temperature=0.7, seed=3, min_tokens=2, presence_penalty=0.5, logprobs=1),
    SamplingParams(temperature=1.3, logit_bias={3: 2.0}, frequency_penalty=0.1),
]


def test_the_device_phase_reads_nothing_back() -> None:
    # A meta tensor has no data: any read on the host (item, tolist, a boolean-mask index
    # whose size depends on values) raises, so this passing means no sync before the copy.
    logits = torch.randn(4, 50, device="meta")
    rows = [_row(p) for p in EVERY_FEATURE]
    bitmask = torch.full((4, 2), -1, dtype=torch.int32)
    raw = raw_logprobs(logits, rows)
    draw = sample_on_device(logits, rows, make_device_generator(0, "cpu"), token_bitmask=bitmask)
    assert draw.host_flags().shape == (3, 4)
    assert logprob_table(raw, draw.tokens).shape == (2, 2 * (1 + 2) + 1)
    with pytest.raises(NotImplementedError):
        draw.tokens.tolist()


@pytest.mark.parametrize("seeded", [True, False])
def test_draws_follow_the_rows_distribution(seeded: bool) -> None:
    # one batch of many rows: seeded ones each with a seed of its own (the hashed noise over
    # many keys), or unseeded ones (the engine generator's exponential noise)
    num_rows = 4000
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log()[None].repeat(num_rows, 1)
    rows = [
        _row(SamplingParams(temperature=1.0, seed=s if seeded else None)) for s in range(num_rows)
    ]
    tokens = sample(logits, rows, make_device_generator(1, "cpu"))
    counts = np.bincount(np.asarray(tokens), minlength=4)
    expected = probs.numpy() * num_rows
    sigma = np.sqrt(expected * (1 - probs.numpy()))
    assert np.all(np.abs(counts - expected) < 4 * sigma), counts


def test_the_generator_noise_is_exp_1() -> None:
    # the CPU draws it as -log1p(-u): mean and variance 1, P(q > t) = exp(-t), all finite > 0
    noise = exponential_noise(1000, 1000, make_device_generator(3, "cpu"), torch.device("cpu"))
    n = noise.numel()
    assert abs(noise.mean().item() - 1) < 4 / np.sqrt(n)
    assert abs(noise.var().item() - 1) < 4 * np.sqrt(8 / n)  # Var of q^2 - 1 is 8 for Exp(1)
    for t in (0.5, 2.0, 5.0):
        p = np.exp(-t)
        assert abs((noise > t).float().mean().item() - p) < 4 * np.sqrt(p * (1 - p) / n)
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise).all())


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hashed_noise_is_the_exact_32_bit_hash_of_keys_and_token() -> None:
    # keys at the edges of 32 bits: a product that overflowed int64 would show here
    keys = [(0, 0), (2**32 - 1, 2**32 - 1), (123456789, 987654321)]
    noise = hashed_noise(torch.tensor(keys, dtype=torch.int64), 300)
    for row, (k0, k1) in enumerate(keys):
        for token in (0, 1, 2, 255, 299):
            h = _lowbias32(_lowbias32(token ^ k0) ^ k1)
            u = np.float32(((h >> 9) + 0.5) / 2**23)
            assert noise[row, token].item() == pytest.approx(-np.log(u), rel=1e-6)
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise).all())


def test_every_row_keeps_its_own_parameters_in_a_mixed_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 64) * 3
    params = [
        SamplingParams(temperature=0.8, top_k=2, seed=1),
        SamplingParams(temperature=1.5, top_p=0.3, seed=2),
        SamplingParams(temperature=0),
        SamplingParams(temperature=2.0, top_k=10, top_p=0.8, seed=3),
    ]
    alone = [
        [
            sample(logits[i : i + 1].clone(), [_row(p, n)], make_device_generator(0, "cpu"))[0]
            for n in range(8)
        ]
        for i, p in enumerate(params)
    ]
    together = [
        sample(logits.clone(), [_row(p, n) for p in params], make_device_generator(0, "cpu"))
        for n in range(8)
    ]
    assert [list(col) for col in zip(*together, strict=True)] == alone
    assert set(alone[0]) <= set(torch.topk(logits[0], 2).indices.tolist())
    assert alone[2] == [int(logits[2].argmax())] * 8


def test_one_copy_gives_the_same_tokens_and_logprobs_as_two() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    rows = [_row(p) for p in EVERY_FEATURE]
    step = sample_step(logits.clone(), rows, make_device_generator(5, "cpu"), None)
    rows = [_row(p) for p in EVERY_FEATURE]  # the seeded generator restarted
    raw = raw_logprobs(logits, rows)
    tokens = sample(logits.clone(), rows, make_device_generator(5, "cpu"))
    assert step.tokens == tokens
    want = gather_logprobs(raw, tokens)
    assert sorted(step.logprobs) == sorted(want) == [0, 2]
    for i, lp in want.items():
        assert np.array_equal(step.logprobs[i].token_ids, lp.token_ids)
        assert np.array_equal(step.logprobs[i].logprobs, lp.logprobs)
        assert np.array_equal(step.logprobs[i].ranks, lp.ranks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_draw_never_syncs_and_seeded_draws_equal_the_cpus() -> None:
    gen = torch.Generator().manual_seed(11)
    keys = torch.randint(0, 2**32, (8, 2), dtype=torch.int64, generator=gen)
    # The hash is integer arithmetic: bit-identical. The log after it is each device's float32
    # log, which rounds differently by an ulp on some tokens (seen on an H200, 2026-12-04), so
    # the noise agrees to a few ulps and the seeded tokens agree exactly (no 1-ulp tie here).
    assert torch.equal(hashed_uniform(keys, 151_936), hashed_uniform(keys.cuda(), 151_936).cpu())
    torch.testing.assert_close(
        hashed_noise(keys.cuda(), 151_936).cpu(), hashed_noise(keys, 151_936), rtol=4e-7, atol=0
    )
    seeded = [_row(SamplingParams(temperature=1.0, seed=s), n) for s, n in ((1, 0), (2, 5), (3, 9))]
    cpu_logits = torch.randn(3, 151_936, generator=gen)
    on_cpu = sample(cpu_logits.clone(), seeded, make_device_generator(0, "cpu"))
    on_cuda = sample(cpu_logits.cuda(), seeded, make_device_generator(0, "cuda"))
    assert on_cuda == on_cpu
    logits = torch.randn(4, 151_936, device="cuda")
    rows = [_row(p) for p in EVERY_FEATURE]
    engine = torch.Generator(device="cuda").manual_seed(0)
    bitmask = torch.full((4, 151_936 // 32), -1, dtype=torch.int32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        raw = raw_logprobs(logits, rows)
        draw = sample_on_device(logits, rows, engine, token_bitmask=bitmask)
        logprob_table(raw, draw.tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert draw.tokens.device.type == "cuda"


class _Unconvertible(float):
    """A temperature that passes every check and fails only when the draw converts it."""

    def __float__(self) -> float:
        raise OverflowError("cannot convert")


def test_a_row_whose_draw_raises_fails_alone() -> None:
    import msgspec

    from mmserve.errors import FailureKind, RequestFailure

    torch.manual_seed(2)
    logits = torch.randn(3, 32)
    good = [SamplingParams(temperature=0.9, seed=1), SamplingParams(temperature=0.5, seed=2)]
    bad = msgspec.structs.replace(SamplingParams(temperature=1.0, seed=3))
    msgspec.structs.force_setattr(bad, "temperature", _Unconvertible(1.0))
    alone = sample(logits[[0, 2]].clone(), [_row(p) for p in good], make_device_generator(0, "cpu"))
    mixed = sample(
        logits.clone(), [_row(good[0]), _row(bad), _row(good[1])], make_device_generator(0, "cpu")
    )
    failure = mixed.pop(1)
    assert isinstance(failure, RequestFailure) and failure.kind is FailureKind.INTERNAL
    assert failure.message == "sampling failed: OverflowError"
    assert mixed == alone
