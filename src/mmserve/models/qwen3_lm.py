"""The Qwen3 decoder of Qwen3-VL, over a flat batch with a paged KV cache, with DeepStack.

Differs from the Qwen2 decoder (`qwen2_lm.py`) in its attention only: q and k are RMS-normed
per head before the rotary, biases only with `attention_bias`, `head_dim` from the config
(not hidden / heads), interleaved M-RoPE. DeepStack adds level k of the visual embeddings to
the hidden states at the visual positions after decoder layer k (k = 0, 1, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mmserve.layers.attention import AttentionMetadata
from mmserve.layers.fused import LayerOps, TorchLayerOps
from mmserve.layers.norm import RMSNorm
from mmserve.layers.rotary import MRotaryEmbedding
from mmserve.models.config import TextConfig
from mmserve.models.qwen2_lm import Qwen2DecoderLayer


@dataclass(frozen=True)
class DeepstackInputs:
    """The step's DeepStack rows: `embeds[k, i]` is added at token `index[i]` after layer k.

    index [num_mm] int64 flat token indices of the step's visual positions; embeds
    [levels, num_mm, hidden] in the model's dtype.
    """

    index: torch.Tensor
    embeds: torch.Tensor


class Qwen3Attention(nn.Module):
    """GQA self-attention with per-head q/k RMSNorm and M-RoPE."""

    def __init__(self, config: TextConfig, ops: LayerOps) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        # normed over head_dim as rows [n * heads, head_dim], the layer ops' 2-D contract
        q = self.q_norm(self.q_proj(x).view(n * self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(n * self.num_kv_heads, self.head_dim))
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rotate_qk(q, k, cos, sin)
        out = attn_metadata.backend.forward(q, k, v, kv_cache, attn_metadata, self.head_dim**-0.5)
        return self.o_proj(out.to(x.dtype).reshape(n, -1))


class Qwen3Model(nn.Module):
    """Token embedding, Qwen3 decoder layers, the final norm (no LM head); `ops` as in
    Qwen2Model."""

    def __init__(self, config: TextConfig, ops: LayerOps | None = None) -> None:
        super().__init__()
        self.config = config
        ops = ops or TorchLayerOps()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            # the Qwen2 pre-norm block (norms, SwiGLU MLP, fused residual), Qwen3 attention
            [
                Qwen2DecoderLayer(config, ops, Qwen3Attention)
                for _ in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.rotary = MRotaryEmbedding(
            config.head_dim, config.rope_theta, config.mrope_section, config.mrope_interleaved
        )

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        deepstack: DeepstackInputs | None = None,
    ) -> torch.Tensor:
        """inputs_embeds [num_tokens, hidden], positions [3, num_tokens] -> [num_tokens, hidden].

        `deepstack`: the step's visual rows (None on text-only and decode steps: nothing extra
        runs). Levels past the last layer are unused, as in transformers.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"got {len(kv_caches)} KV caches for {len(self.layers)} decoder layers; "
                "allocate them with allocate_kv_caches(model_config, ...)"
            )
        cos, sin = self.rotary(positions)  # [num_tokens, head_dim] float32
        num_levels = 0 if deepstack is None else deepstack.embeds.shape[0]
        x, residual = inputs_embeds, None
        for layer_idx, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(x, residual, cos, sin, kv_cache, attn_metadata)
            if layer_idx < num_levels:
                # The layer's output is x + residual (the next norm would add them): add them
                # here, add the level at the visual rows, and start the next layer afresh.
                assert deepstack is not None
                hidden = x + residual
                x = hidden.index_add(0, deepstack.index, deepstack.embeds[layer_idx])
                residual = None
        if residual is None:  # a model without layers
            return self.norm(x)
        return self.norm.add_and_norm(x, residual)[0]
