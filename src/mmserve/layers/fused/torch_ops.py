"""The reference layer ops in plain torch: the CPU path, and the oracle of the Triton ones."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmserve.layers.rotary import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden] -> weight * x / rms(x), normalised in float32."""
    input_dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    # Cast before scaling, as the checkpoints were trained that way.
    return weight * x32.to(input_dtype)


class TorchLayerOps:
    """Unfused: each op is a few torch kernels, rounding to the model's dtype between them."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return rms_norm(summed, weight, eps), summed

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def rotate_qk(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
