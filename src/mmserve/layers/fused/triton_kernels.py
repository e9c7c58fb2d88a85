"""Triton kernels of the decoder layer's elementwise work: RMSNorm (+ residual add), SwiGLU,
rotary on q and k in place.

Imported only by `triton_ops.py`. As in `layers/attention/triton_kernels.py`, the functions
stay plain Python until `compile_kernels` hands them to `triton.jit` (interpreted when
TRITON_INTERPRET=1 is set at that moment), and there is no `from __future__ import
annotations`: Triton reads the `tl.constexpr` annotations as objects.

Every kernel rounds to the model's dtype where the torch reference (`torch_ops.py`) rounds,
so on CUDA the two differ only by the order of a float32 sum and by fused multiply-adds.
"""

from typing import Any, NamedTuple

import triton
import triton.language as tl


def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row. With a residual: s = x + residual (rounded), stored, then normed;
    the row is read once and each output written once (the fusion's whole point)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / hidden_size
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(x.dtype)  # cast before scaling, as Qwen2
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _silu_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    stride_gate,
    stride_up,
    stride_out,
    num_cols,
    BLOCK: tl.constexpr,
):
    """Grid (rows, column blocks): out = silu(gate) * up. The strides let gate and up be the two
    halves of one merged gate_up projection as well as two tensors."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)  # torch rounds silu's result
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rotary_kernel(
    query_ptr,
    key_ptr,
    cos_ptr,
    sin_ptr,
    stride_query_token,
    stride_query_head,
    stride_key_token,
    stride_key_head,
    stride_cos_token,
    num_query_heads,
    num_key_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    """One program per token: its query heads, then its key heads, rotated in place as rows of
    one tile: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]. cos/sin rows are laid out
    [freqs, freqs] (rotary.py), so only their first half is read; the M-RoPE sections were
    picked once per step when cos/sin were built, for every layer."""
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    is_dim = dims < HALF
    cos = tl.load(cos_ptr + token * stride_cos_token + dims, mask=is_dim, other=0.0)
    sin = tl.load(sin_ptr + token * stride_cos_token + dims, mask=is_dim, other=0.0)
    heads = tl.arange(0, HEADS_PAD)
    is_query = heads < num_query_heads
    key_head = tl.where(is_query, 0, heads - num_query_heads)
    row_ptr = tl.where(
        is_query,
        query_ptr + token * stride_query_token + heads * stride_query_head,
        key_ptr + token * stride_key_token + key_head * stride_key_head,
    )  # [HEADS_PAD]: where each row's head starts
    mask = (heads < num_query_heads + num_key_heads)[:, None] & is_dim[None, :]
    first = row_ptr[:, None] + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    x1_32, x2_32 = x1.to(tl.float32), x2.to(tl.float32)
    cos, sin = cos[None, :], sin[None, :]
    tl.store(first, (x1_32 * cos - x2_32 * sin).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (x2_32 * cos + x1_32 * sin).to(x1.dtype), mask=mask)


class FusedKernels(NamedTuple):
    rms_norm: Any  # triton.JITFunction, or an InterpretedFunction
    silu_mul: Any
    rotary: Any
    is_interpreted: bool


def compile_kernels() -> FusedKernels:
    """The kernels, jitted now (interpreted when TRITON_INTERPRET=1 is set at this moment)."""
    return FusedKernels(
        rms_norm=triton.jit(_rms_norm_kernel),
        silu_mul=triton.jit(_silu_mul_kernel),
        rotary=triton.jit(_rotary_kernel),
        is_interpreted=bool(triton.knobs.runtime.interpret),
    )
