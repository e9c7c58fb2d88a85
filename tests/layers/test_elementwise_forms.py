"""The eager forms of the rotary and quick_gelu that save temporaries give the very floats of the
plain formulas (transformers' own), for every dtype, layout and autograd state they meet."""

from __future__ import annotations

import pytest
import torch

from mmserve.layers.activation import quick_gelu
from mmserve.layers.rotary import apply_rotary, rotate_half


def _plain_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1024, 4, 16), (7, 3, 8), (33, 2, 128)])
def test_rotary_is_the_plain_formula_bit_for_bit(dtype, shape) -> None:
    gen = torch.Generator().manual_seed(0)
    n, heads, dim = shape
    # q as the attention makes it: a strided view of the stacked q/k/v projection
    x = (torch.randn(n, 3, heads, dim, generator=gen) * 3).to(dtype)[:, 0]
    angles = torch.randn(n, dim // 2, generator=gen) * 50
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    got = apply_rotary(x, cos, sin)
    assert got.dtype == dtype
    assert torch.equal(got, _plain_rotary(x, cos, sin))


def test_rotary_under_autograd_keeps_its_gradient() -> None:
    x = torch.randn(5, 2, 8, requires_grad=True)
    emb = torch.randn(5, 8)
    out = apply_rotary(x, emb.cos(), emb.sin())
    assert torch.equal(out, _plain_rotary(x, emb.cos(), emb.sin()))
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_quick_gelu_is_the_plain_formula_bit_for_bit() -> None:
    x = torch.randn(4096, 37, generator=torch.Generator().manual_seed(1)) * 6
    assert torch.equal(quick_gelu(x), x * torch.sigmoid(1.702 * x))
