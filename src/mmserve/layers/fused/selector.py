"""Which layer ops go with the attention backend: fused Triton ones with the triton backend."""

from __future__ import annotations

from mmserve.layers.fused.ops import LayerOps
from mmserve.layers.fused.torch_ops import TorchLayerOps


def select_layer_ops(attention_backend: str) -> LayerOps:
    """`triton` attention (CUDA, or the CPU under TRITON_INTERPRET=1, which
    `select_backend` already checked) gets the fused Triton ops; torch attention keeps the torch
    ops, so the CPU path and the oracle stay plain torch."""
    if attention_backend == "triton":
        from mmserve.layers.fused.triton_ops import TritonLayerOps

        return TritonLayerOps()
    return TorchLayerOps()
