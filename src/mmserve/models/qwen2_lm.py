"""The Qwen2 decoder used by Qwen2-VL and Qwen2.5-VL, over a flat batch with a paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.layers.activation import get_activation
from mmserve.layers.attention import AttentionMetadata
from mmserve.layers.norm import RMSNorm
from mmserve.layers.rotary import MRotaryEmbedding, apply_rotary
from mmserve.models.config import TextConfig


class Qwen2Attention(nn.Module):
    """GQA self-attention with q/k/v biases and M-RoPE."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # The step's metadata names the backend that built it (chosen once at start-up).
        out = attn_metadata.backend.forward(q, k, v, kv_cache, attn_metadata, self.head_dim**-0.5)
        return self.o_proj(out.to(x.dtype).reshape(n, -1))


class Qwen2MLP(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(config)
        self.mlp = Qwen2MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn_metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    """Token embedding, decoder layers and the final norm (no LM head)."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen2DecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = MRotaryEmbedding(config.head_dim, config.rope_theta, config.mrope_section)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """inputs_embeds [num_tokens, hidden], positions [3, num_tokens] -> [num_tokens, hidden]."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"got {len(kv_caches)} KV caches for {len(self.layers)} decoder layers; "
                "allocate them with allocate_kv_caches(model_config, ...)"
            )
        cos, sin = self.rotary(positions)  # [num_tokens, head_dim] float32
        x = inputs_embeds
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, attn_metadata)
        return self.norm(x)
