"""The decoder layer's elementwise work (RMSNorm with the residual add, SwiGLU, rotary on q and
k) as one seam with two implementations, chosen once at start-up with the attention backend.

`ops.py` (the protocol), `torch_ops.py` (the reference: the CPU path and the oracle),
`triton_ops.py` + `triton_kernels.py` (fused Triton kernels for CUDA, or Triton's interpreter
on the CPU), `selector.py` (which one goes with which attention backend).

NOTE: why our own kernels and not liger-kernel (0.8.5, BSD-2, pure Python + Triton, checked
2026-12): its RMSNorm, fused add + RMSNorm and SwiGLU kernels fail under TRITON_INTERPRET=1 on
Triton 3.9 (`.to()` on a float scalar argument), so CI could not test them on the CPU; they are
training kernels (autograd Functions that save `rstd` for a backward pass, one more allocation
per call, and `ensure_contiguous` copies); its Qwen2-VL M-RoPE (which does run interpreted)
wants q/k as [batch, heads, seq, dim] and per-axis cos/sin [3, batch, seq, dim], where ours are
a flat [tokens, heads, dim] and cos/sin with the sections already picked once per step, and it
silently rotates a copy when q is not contiguous. Importing it takes ~2.5 s (every op module)
and the bare GPU machine would need it vendored. Ours are three short kernels.
"""

from mmserve.layers.fused.ops import LayerOps
from mmserve.layers.fused.selector import select_layer_ops
from mmserve.layers.fused.torch_ops import TorchLayerOps

__all__ = ["LayerOps", "TorchLayerOps", "select_layer_ops"]
