"""The fused Triton layer ops against the torch reference, on the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from mmserve.layers.fused import TorchLayerOps, select_layer_ops
from mmserve.layers.rotary import MRotaryEmbedding

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not triton.knobs.runtime.interpret,
    reason="the interpreter tests need TRITON_INTERPRET=1 before triton is imported "
    "(tests/conftest.py sets it on machines without CUDA)",
)

# bfloat16 allows two roundings' worth: the interpreter truncates float32 -> bfloat16 casts
# (Triton 3.9) where torch rounds to nearest.
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
}
DTYPES = list(TOLERANCE)
REFERENCE = TorchLayerOps()


@pytest.fixture(scope="module")
def fused():
    """Triton layer ops whose kernels run in the interpreter, on the CPU."""
    return select_layer_ops("triton")


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[want.dtype])


def test_the_fused_ops_go_with_the_triton_backend_only(fused) -> None:
    assert fused.name == "triton"
    assert select_layer_ops("torch").name == "torch"


# Qwen2-VL-2B's and 7B's hidden sizes, and one that is not a power of two nor a multiple of 16.
@pytest.mark.parametrize("hidden_size", [1536, 3584, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_the_residual_add(fused, hidden_size, dtype) -> None:
    x, residual = _randn(2, 3, hidden_size, dtype=dtype, seed=hidden_size)
    weight = 1 + 0.1 * _randn(hidden_size, dtype=dtype, seed=1)
    x_before, residual_before = x.clone(), residual.clone()
    _close(fused.rms_norm(x, weight, 1e-6), REFERENCE.rms_norm(x, weight, 1e-6))
    got_normed, got_summed = fused.add_rms_norm(x, residual, weight, 1e-6)
    want_normed, want_summed = REFERENCE.add_rms_norm(x, residual, weight, 1e-6)
    _close(got_summed, want_summed)
    _close(got_normed, want_normed)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_of_odd_row_counts_and_strided_rows(fused) -> None:
    weight = _randn(200, dtype=torch.float32, seed=2)
    for num_rows in (0, 1, 7):
        x = _randn(num_rows, 200, dtype=torch.float32, seed=num_rows)
        _close(fused.rms_norm(x, weight, 1e-5), REFERENCE.rms_norm(x, weight, 1e-5))
    wide = _randn(5, 300, dtype=torch.float32, seed=3)
    x, residual = wide[:, :200], wide[:, 100:]  # rows 300 apart, overlapping: read-only inputs
    for got, want in zip(
        fused.add_rms_norm(x, residual, weight, 1e-5),
        REFERENCE.add_rms_norm(x, residual, weight, 1e-5),
        strict=True,
    ):
        _close(got, want)


# The 2B's and 7B's intermediate sizes, and an odd one; one row each keeps the interpreter quick.
@pytest.mark.parametrize("intermediate_size", [8960, 18944, 333])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(fused, intermediate_size, dtype) -> None:
    gate = 3 * _randn(3, intermediate_size, dtype=dtype, seed=intermediate_size)
    up = _randn(3, intermediate_size, dtype=dtype, seed=7)
    _close(fused.silu_mul(gate, up), REFERENCE.silu_mul(gate, up))


def test_silu_mul_on_the_halves_of_a_merged_gate_up_output(fused) -> None:
    gate_up = _randn(5, 2 * 300, dtype=torch.float32, seed=4)  # [num_tokens, 2 * intermediate]
    gate, up = gate_up[:, :300], gate_up[:, 300:]
    _close(fused.silu_mul(gate, up), REFERENCE.silu_mul(gate, up))
    assert fused.silu_mul(gate[:0], up[:0]).shape == (0, 300)


def _mrope_cos_sin(num_tokens: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of an image's M-RoPE positions: the three axes differ, so every section counts."""
    height_width = 3 * head_dim // 16  # Qwen2-VL's (16, 24, 24) at head_dim 128
    sections = (head_dim // 2 - 2 * height_width, height_width, height_width)
    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, 4096, (3, num_tokens), generator=gen)
    return MRotaryEmbedding(head_dim, 1e6, sections)(positions)


# (head_dim, query heads, KV heads): the LM's 128 at the 2B's and 7B's head counts, and the
# head dims 64, 80, 72 and 24 (halves of 40, 36 and 12 padded in the kernel, the tail masked).
@pytest.mark.parametrize(
    ("head_dim", "num_heads", "num_kv_heads"),
    [(128, 12, 2), (128, 28, 4), (80, 4, 4), (64, 3, 1), (72, 8, 2), (24, 4, 2)],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rotates_query_and_key_in_place(fused, head_dim, num_heads, num_kv_heads, dtype):
    num_tokens = 5
    query = _randn(num_tokens, num_heads, head_dim, dtype=dtype, seed=head_dim + num_heads)
    key = _randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, seed=num_kv_heads)
    cos, sin = _mrope_cos_sin(num_tokens, head_dim)
    want_query, want_key = REFERENCE.rotate_qk(query, key, cos, sin)
    query_ptr, key_ptr = query.data_ptr(), key.data_ptr()
    got_query, got_key = fused.rotate_qk(query, key, cos, sin)
    assert (got_query.data_ptr(), got_key.data_ptr()) == (query_ptr, key_ptr)  # in place
    _close(got_query, want_query)
    _close(got_key, want_key)


def test_rotary_on_views_of_one_projection_output(fused) -> None:
    """q and k as strided views of a merged qkv output: rotated in place, v left alone."""
    num_tokens, heads, kv_heads, head_dim = 3, 4, 2, 64
    qkv = _randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.float32, seed=5)
    want = qkv.clone()
    query = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(
        num_tokens, kv_heads, head_dim
    )
    cos, sin = _mrope_cos_sin(num_tokens, head_dim)
    want_query, want_key = REFERENCE.rotate_qk(query, key, cos, sin)
    fused.rotate_qk(query, key, cos, sin)
    _close(query, want_query)
    _close(key, want_key)
    value_cols = slice((heads + kv_heads) * head_dim, None)
    assert torch.equal(qkv[:, value_cols], want[:, value_cols])
