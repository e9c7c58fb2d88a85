"""The decoder layer's elementwise ops, fused Triton kernels against torch, at 7B shapes.

Per op and token count (a decode at batch 1 and 64, a 2048-token prefill), microseconds per
call of `TritonLayerOps` and `TorchLayerOps`; their sum over one decoder layer's calls (two
add-norms, one SwiGLU, one rotary) times the layer count is what the fused path saves per step.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from benchmarks.suite.profile import Profile
from benchmarks.suite.timing import best_seconds

from mmserve.layers.fused import TorchLayerOps, select_layer_ops
from mmserve.layers.rotary import MRotaryEmbedding


def _inputs(shape: dict[str, int], num_tokens: int, device: str, dtype: torch.dtype) -> dict:
    gen = torch.Generator(device=device).manual_seed(num_tokens)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=device, generator=gen).to(dtype)

    hidden, inter, head_dim = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    quarter = 3 * head_dim // 16
    rotary = MRotaryEmbedding(head_dim, 1e6, (head_dim // 2 - 2 * quarter, quarter, quarter))
    cos, sin = rotary(torch.arange(num_tokens, device=device))
    return {
        "x": randn(num_tokens, hidden),
        "residual": randn(num_tokens, hidden),
        "weight": randn(hidden),
        "gate": randn(num_tokens, inter),
        "up": randn(num_tokens, inter),
        "query": randn(num_tokens, shape["num_heads"], head_dim),
        "key": randn(num_tokens, shape["num_kv_heads"], head_dim),
        "cos": cos,
        "sin": sin,
    }


def _op_us(ops: Any, name: str, t: dict, profile: Profile) -> float:
    calls = {
        "add_rms_norm": lambda: ops.add_rms_norm(t["x"], t["residual"], t["weight"], 1e-6),
        "silu_mul": lambda: ops.silu_mul(t["gate"], t["up"]),
        # rotating the same tensors again and again: the values drift, the time does not
        "rotate_qk": lambda: ops.rotate_qk(t["query"], t["key"], t["cos"], t["sin"]),
    }

    def loop() -> None:
        for _ in range(profile.layer_ops_calls):
            calls[name]()

    seconds = best_seconds(loop, profile.layer_ops_repeats, profile.device)
    return seconds / profile.layer_ops_calls * 1e6


def measure_layer_ops(profile: Profile) -> dict[str, Any]:
    device, dtype = profile.device, getattr(torch, profile.dtype)
    has_triton = device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    implementations = {"torch": TorchLayerOps()}
    if has_triton:
        implementations["triton"] = select_layer_ops("triton")
    shape = profile.layer_ops_shape
    rows = []
    for num_tokens in profile.layer_ops_tokens:
        inputs = _inputs(shape, num_tokens, device, dtype)
        row: dict[str, Any] = {"num_tokens": num_tokens}
        for impl, ops in implementations.items():
            us = {
                op: _op_us(ops, op, inputs, profile)
                for op in ("add_rms_norm", "silu_mul", "rotate_qk")
            }
            per_layer = 2 * us["add_rms_norm"] + us["silu_mul"] + us["rotate_qk"]
            row[impl] = {**us, "per_step_ms": per_layer * shape["num_layers"] / 1e3}
        if "triton" in row:
            row["saved_ms_per_step"] = row["torch"]["per_step_ms"] - row["triton"]["per_step_ms"]
        rows.append(row)
    return {
        "shape": shape,
        "dtype": profile.dtype,
        "rows": rows,
        "triton": has_triton or "skipped: no CUDA device and no TRITON_INTERPRET=1",
    }
