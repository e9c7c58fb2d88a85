"""The Triton kernels against the torch reference, on the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import random

import pytest
import torch

from mmserve.layers.attention import TorchAttentionBackend, select_backend, write_kv_cache
from tests.layers.triton_cases import MIXED_BATCH, make_batch, reference, run_backend

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not triton.knobs.runtime.interpret,
    reason="the interpreter tests need TRITON_INTERPRET=1 before triton is imported "
    "(tests/conftest.py sets it on machines without CUDA)",
)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def triton_backend():
    """A Triton backend whose kernels run in the interpreter, on the CPU."""
    from mmserve.layers.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


# (dtype, head_dim, query heads per KV head, block_size): every head dim, GQA ratio, block size
# and dtype appears, without the full product (the interpreter is slow). Head dims that are not
# powers of two run padded with a masked tail: 24 (tiny test models) in 32, 72 (Qwen3-VL's
# vision head) and 80 in 128, and 20 (not even a multiple of 8) in 32.
CASES = [
    (torch.float32, 64, 1, 16),
    (torch.float32, 80, 2, 32),
    (torch.float32, 128, 4, 16),
    (torch.float16, 80, 4, 16),
    (torch.float16, 64, 2, 32),
    (torch.bfloat16, 128, 2, 32),
    (torch.bfloat16, 80, 1, 16),
    (torch.float32, 24, 4, 16),
    (torch.bfloat16, 24, 1, 32),
    (torch.float32, 72, 2, 32),
    (torch.float16, 72, 4, 16),
    (torch.float32, 20, 2, 16),
]


@pytest.mark.parametrize(("dtype", "head_dim", "group", "block_size"), CASES)
def test_paged_attention_matches_the_torch_backend(
    triton_backend, dtype: torch.dtype, head_dim: int, group: int, block_size: int
) -> None:
    batch = make_batch(
        MIXED_BATCH,
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=head_dim + group,
    )
    want, want_cache = reference(batch)
    got, got_cache = run_backend(triton_backend, batch)
    assert got.shape == want.shape and got.dtype == dtype
    assert torch.equal(got_cache, want_cache)  # the store wrote the same slots, nothing else
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=0)


def test_a_batch_of_decodes_only_and_of_one_long_prefill(triton_backend) -> None:
    for shapes in ([(c, 1) for c in (0, 3, 15, 16, 31, 40)], [(0, 70)], [(33, 40)]):
        batch = make_batch(
            shapes, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32
        )
        torch.testing.assert_close(
            run_backend(triton_backend, batch)[0], reference(batch)[0], atol=1e-5, rtol=0
        )


def test_slots_past_a_sequence_never_reach_its_output(triton_backend) -> None:
    """A freed block may hold NaN (a failed request's KV): the kernel reads masked slots as 0."""
    batch = make_batch(
        [(0, 5), (20, 1)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
    )
    poisoned = batch.kv_cache.clone()
    for (cached, new), table in zip(batch.shapes, batch.tables, strict=True):
        last = table[-1]
        poisoned[:, last, (cached + new) % 16 :] = float("nan")
    clean_out, _ = run_backend(triton_backend, batch)
    out, _ = run_backend(triton_backend, type(batch)(**{**batch.__dict__, "kv_cache": poisoned}))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean_out, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("cache_dtype", "head_dim"), [(torch.float32, 80), (torch.bfloat16, 80), (torch.float32, 72)]
)
def test_kv_store_matches_write_kv_cache(
    triton_backend, cache_dtype: torch.dtype, head_dim: int
) -> None:
    from mmserve.layers.attention.triton_backend import store_kv

    rng = random.Random(0)
    num_blocks, block_size, num_kv_heads = 9, 16, 3
    slots = rng.sample(range(num_blocks * block_size), 37)  # shuffled, scattered
    wide = torch.randn(37, num_kv_heads, head_dim + 8)
    key = wide[:, :, :head_dim]  # strided rows: the kernel follows the strides
    value = torch.randn(37, num_kv_heads, head_dim)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    start = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype)
    want, got = start.clone(), start.clone()
    write_kv_cache(want, key, value, slot_mapping)
    store_kv(triton_backend, got, key, value, slot_mapping)
    assert torch.equal(got, want)
    # A negative slot is a padding token: it is skipped and every other slot is written.
    padded = torch.tensor([-1, *slots[1:]], dtype=torch.int64)
    got = start.clone()
    store_kv(triton_backend, got, key, value, padded)
    want = start.clone()
    write_kv_cache(want, key[1:], value[1:], padded[1:])
    assert torch.equal(got, want)


def test_select_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert isinstance(select_backend("auto", "cpu"), TorchAttentionBackend)
    assert select_backend("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", "cpu")
    with pytest.raises(ValueError, match="auto, torch or triton"):
        select_backend("flash", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("triton", "cpu", block_size=32).name == "triton"
    with pytest.raises(ValueError, match="--block-size 8.*power of two >= 16"):
        select_backend("triton", "cpu", block_size=8)


def test_the_head_dim_is_checked_at_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a power of two is fine; what the kernels cannot take stops start-up naming it, and
    `auto` on CUDA falls back to torch (which takes any) instead."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for head_dim in (24, 72, 80, 128, 256):
        assert select_backend("triton", "cpu", head_dim=head_dim).name == "triton"
    for head_dim in (288, 512, 23):
        with pytest.raises(ValueError, match=f"head_dim {head_dim}: the triton attention"):
            select_backend("triton", "cpu", head_dim=head_dim)
    assert select_backend("torch", "cpu", head_dim=512).name == "torch"
    assert select_backend("auto", "cuda", head_dim=72).name == "triton"
    assert select_backend("auto", "cuda", head_dim=512).name == "torch"


def test_a_missing_triton_package_names_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "triton", None)  # what an environment without it finds
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="--attention-backend triton needs the `triton` package"):
        select_backend("triton", "cpu")
    assert select_backend("auto", "cpu").name == "torch"
