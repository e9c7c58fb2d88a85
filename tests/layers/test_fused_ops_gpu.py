"""The fused Triton layer ops compiled for CUDA against the torch ops, at Qwen2-VL-7B shapes."""

from __future__ import annotations

import pytest
import torch

from mmserve.layers.fused import TorchLayerOps
from mmserve.layers.rotary import MRotaryEmbedding

triton = pytest.importorskip("triton")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        bool(triton.knobs.runtime.interpret), reason="TRITON_INTERPRET=1 is set: not compiled"
    ),
]

REFERENCE = TorchLayerOps()
# Compiled casts round to nearest as torch does: what is left is the float32 sum order and FMAs.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 8e-3)}


@pytest.fixture(scope="module")
def fused():
    from mmserve.layers.fused.triton_ops import TritonLayerOps

    return TritonLayerOps()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    atol, rtol = TOLERANCE[want.dtype]
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_the_ops_at_7b_shapes(fused, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    x, residual, weight = randn(2049, 3584), randn(2049, 3584), 1 + 0.1 * randn(3584)
    for got, want in zip(
        fused.add_rms_norm(x, residual, weight, 1e-6),
        REFERENCE.add_rms_norm(x, residual, weight, 1e-6),
        strict=True,
    ):
        _close(got, want)
    _close(fused.rms_norm(x, weight, 1e-6), REFERENCE.rms_norm(x, weight, 1e-6))
    gate_up = 3 * randn(257, 2 * 18944)
    gate, up = gate_up[:, :18944], gate_up[:, 18944:]
    _close(fused.silu_mul(gate, up), REFERENCE.silu_mul(gate, up))
    query, key = randn(2049, 28, 128), randn(2049, 4, 128)
    positions = torch.randint(0, 30000, (3, 2049), device="cuda", generator=gen)
    cos, sin = MRotaryEmbedding(128, 1e6, (16, 24, 24))(positions)
    want_query, want_key = REFERENCE.rotate_qk(query, key, cos, sin)
    got_query, got_key = fused.rotate_qk(query, key, cos, sin)
    _close(got_query, want_query)
    _close(got_key, want_key)
