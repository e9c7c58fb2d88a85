"""The layer-ops seam: what a decoder layer asks of whoever does its elementwise work."""

from __future__ import annotations

from typing import Protocol

import torch


class LayerOps(Protocol):
    """RMSNorm, the residual add, SwiGLU and rotary for the Qwen2 decoder.

    Contract (every implementation agrees with `TorchLayerOps`, the reference, to rounding):

    - `rms_norm(x, weight, eps)`: x [num_tokens, hidden] -> weight * norm(x), normalised in
      float32, cast to x's dtype before the scale (the Qwen2 recipe).
    - `add_rms_norm(x, residual, weight, eps)` -> (rms_norm(s), s) with s = x + residual in
      x's dtype: the residual stream's add fused into the next norm.
    - `silu_mul(gate, up)` -> silu(gate) * up, both [num_tokens, intermediate] (rows may be
      strided, e.g. the halves of one merged gate_up output).
    - `rotate_qk(query, key, cos, sin)` -> (query, key) rotated ("rotate half", rotary.py):
      query [num_tokens, num_heads, head_dim], key [num_tokens, num_kv_heads, head_dim], cos/sin
      [num_tokens, head_dim] float32 laid out [freqs, freqs]. It may rotate in place: callers
      use the returned tensors and never the inputs again.

    Inputs are not modified except by `rotate_qk` as said.
    """

    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...

    def rotate_qk(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
