"""The Qwen3 decoder of Qwen3-VL: the Qwen2 decoder stack of `qwen2_lm.py` (which also adds
DeepStack: level k of the visual embeddings at the visual positions after layer k) with
Qwen3's attention: q and k RMS-normed per head before the rotary, biases only with
`attention_bias`, `head_dim` from the config (not hidden / heads); the rotary interleaves the
M-RoPE sections (`TextConfig.mrope_interleaved`).
"""

from __future__ import annotations

import torch

from mmserve.layers.fused import LayerOps
from mmserve.layers.norm import RMSNorm
from mmserve.layers.parallel import SINGLE, TPGroup
from mmserve.models.config import TextConfig
from mmserve.models.qwen2_lm import Qwen2Attention, Qwen2Model


class Qwen3Attention(Qwen2Attention):
    """GQA self-attention with per-head q/k RMSNorm before M-RoPE; biases (all four
    projections) only with `attention_bias`."""

    def __init__(self, config: TextConfig, ops: LayerOps, tp: TPGroup = SINGLE) -> None:
        bias = config.attention_bias
        super().__init__(config, ops, tp, qkv_bias=bias, o_bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # normed over head_dim as rows [n * heads, head_dim], the layer ops' 2-D contract (a
        # copy: q and k are strided views of the fused q/k/v output)
        n, num_heads, num_kv_heads = q.shape[0], q.shape[1], k.shape[1]
        q = self.q_norm(q.reshape(n * num_heads, self.head_dim))
        k = self.k_norm(k.reshape(n * num_kv_heads, self.head_dim))
        return q.view(n, num_heads, self.head_dim), k.view(n, num_kv_heads, self.head_dim)


class Qwen3Model(Qwen2Model):
    """Token embedding, decoder layers (Qwen2's pre-norm block and SwiGLU MLP with Qwen3
    attention), the final norm; DeepStack and `ops` as in Qwen2Model."""

    attention = Qwen3Attention
