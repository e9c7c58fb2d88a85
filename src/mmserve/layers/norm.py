"""RMSNorm in float32 (the Qwen2 recipe: normalise in fp32, cast back, then scale)."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.layers.fused.ops import LayerOps
from mmserve.layers.fused.torch_ops import TorchLayerOps


class RMSNorm(nn.Module):
    """The norm's weight; `ops` (the decoder's, chosen at start-up; torch by default) computes."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, ops: LayerOps | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops or TorchLayerOps()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add, fused into the norm."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
