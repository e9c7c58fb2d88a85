"""The layer ops as fused Triton kernels (`triton_kernels.py`): one launch per op.

CUDA is their home; on the CPU they run under Triton's interpreter (TRITON_INTERPRET=1), which
is how the tests check them against `TorchLayerOps`.
"""

from __future__ import annotations

from typing import Any

import torch

from mmserve.layers.fused.triton_kernels import compile_kernels

# Columns per SwiGLU program (the last block of a row is masked): 1024 at 4 warps keeps a
# program's registers small and gives a 7B row (18944 columns) 19 programs.
SILU_MUL_COLUMNS = 1024


class TritonLayerOps:
    """RMSNorm (+ residual), SwiGLU and rotary in Triton; outputs in the inputs' dtype."""

    name = "triton"

    def __init__(self) -> None:
        self.kernels = compile_kernels()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm(x, None, weight, eps)[0]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._norm(x, residual, weight, eps)

    def _norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_size = x.shape[-1]
        x2d = _rows(x)
        out = torch.empty(
            x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device
        )
        summed = x
        if residual is not None:
            assert residual.shape == x.shape and residual.dtype == x.dtype
            residual2d = _rows(residual)
            summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        else:
            residual2d = x2d  # not read: HAS_RESIDUAL is off
        summed2d, out2d = _rows(summed), _rows(out)
        if x2d.shape[0] == 0:
            return out, summed
        self.kernels.rms_norm[(x2d.shape[0],)](
            x2d,
            residual2d,
            weight,
            out2d,
            summed2d,
            x2d.stride(0),
            residual2d.stride(0),
            out2d.stride(0),
            summed2d.stride(0),
            hidden_size,
            eps,
            **rms_norm_specialisation(hidden_size, has_residual=residual is not None),
        )
        return out, summed

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        assert gate.shape == up.shape and gate.dim() == 2
        assert gate.stride(1) == 1 and up.stride(1) == 1
        num_rows, num_cols = gate.shape
        out = torch.empty(
            gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device
        )
        if num_rows == 0:
            return out
        spec = silu_mul_specialisation(num_cols)
        grid = (num_rows, -(-num_cols // spec["BLOCK"]))
        self.kernels.silu_mul[grid](
            gate, up, out, gate.stride(0), up.stride(0), out.stride(0), num_cols, **spec
        )
        return out

    def rotate_qk(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        assert key.shape == (num_tokens, num_kv_heads, head_dim) and key.dtype == query.dtype
        assert cos.shape == sin.shape == (num_tokens, head_dim) and cos.stride() == sin.stride()
        assert query.stride(2) == key.stride(2) == cos.stride(1) == 1 and head_dim % 2 == 0
        if num_tokens == 0:
            return query, key
        self.kernels.rotary[(num_tokens,)](
            query,
            key,
            cos,
            sin,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            cos.stride(0),
            num_heads,
            num_kv_heads,
            **rotary_specialisation(head_dim, num_heads, num_kv_heads),
        )
        return query, key


# What each launch is compiled for: constexprs and `num_warps` (tests/layers/aot_compile.py
# lowers the same ones for sm_90 without a GPU).
def rms_norm_specialisation(hidden_size: int, *, has_residual: bool) -> dict[str, Any]:
    block = _next_power_of_two(hidden_size)
    return {"HAS_RESIDUAL": has_residual, "BLOCK": block, "num_warps": 8 if block >= 2048 else 4}


def silu_mul_specialisation(num_cols: int) -> dict[str, Any]:
    return {"BLOCK": min(SILU_MUL_COLUMNS, _next_power_of_two(num_cols))}


def rotary_specialisation(head_dim: int, num_heads: int, num_kv_heads: int) -> dict[str, Any]:
    half = head_dim // 2
    return {
        "HALF": half,
        "HALF_PAD": _next_power_of_two(half),
        "HEADS_PAD": _next_power_of_two(num_heads + num_kv_heads),
    }


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, hidden] without a copy when it can be (a norm's input is a row batch)."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()
