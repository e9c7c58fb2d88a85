"""The Qwen2 decoder used by Qwen2-VL and Qwen2.5-VL, over a flat batch with a paged KV cache.

The same stack, with Qwen3's attention (`qwen3_lm.py`), is Qwen3-VL's decoder; it takes the
step's DeepStack rows (`DeepstackInputs`) and adds level k at the visual positions after layer
k. Qwen2-VL and Qwen2.5-VL never pass any: nothing extra runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mmserve.layers.activation import get_activation
from mmserve.layers.attention import AttentionMetadata
from mmserve.layers.fused import LayerOps, TorchLayerOps
from mmserve.layers.norm import RMSNorm
from mmserve.layers.parallel import (
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    split_heads,
)
from mmserve.layers.rotary import MRotaryEmbedding
from mmserve.models.config import TextConfig


@dataclass(frozen=True)
class DeepstackInputs:
    """The step's DeepStack rows: `embeds[k, i]` is added at token `index[i]` after layer k.

    index [num_mm] int64 flat token indices of the step's visual positions; embeds
    [levels, num_mm, hidden] in the model's dtype.
    """

    index: torch.Tensor
    embeds: torch.Tensor


class Qwen2Attention(nn.Module):
    """GQA self-attention with q/k/v biases and M-RoPE: one fused q/k/v projection
    (column-parallel over this rank's heads) and a row-parallel o_proj (one all-reduce)."""

    def __init__(
        self,
        config: TextConfig,
        ops: LayerOps,
        tp: TPGroup = SINGLE,
        *,
        qkv_bias: bool = True,
        o_bias: bool = False,
    ) -> None:
        super().__init__()
        self.ops = ops
        heads = split_heads(config.num_attention_heads, config.num_key_value_heads, tp)
        self.num_heads = heads.num_heads  # this rank's
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.qkv_proj = ColumnParallelLinear.qkv(
            hidden,
            self.head_dim,
            heads,
            (config.num_attention_heads, config.num_key_value_heads),
            ("q_proj", "k_proj", "v_proj"),
            bias=qkv_bias,
            tp=tp,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            hidden,
            bias=o_bias,
            tp=tp,
            what="attention width",
        )

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, heads, head_dim], k [n, kv_heads, head_dim] before the rotary (Qwen3 norms)."""
        return q, k

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        # [n, (heads + 2 * kv_heads) * head_dim], split into strided views
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q, k = self.norm_qk(
            q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim)
        )
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rotate_qk(q, k, cos, sin)
        # The step's metadata names the backend that built it (chosen once at start-up).
        out = attn_metadata.backend.forward(q, k, v, kv_cache, attn_metadata, self.head_dim**-0.5)
        return self.o_proj(out.to(x.dtype).reshape(n, -1))


class Qwen2MLP(nn.Module):
    """SwiGLU: one fused gate/up projection (column-parallel) and a row-parallel down_proj."""

    def __init__(self, config: TextConfig, ops: LayerOps, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.ops = ops
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear.merged(
            config.hidden_size,
            [inter, inter],
            ["gate_proj", "up_proj"],
            bias=False,
            tp=tp,
            what="intermediate_size",
        )
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, bias=False, tp=tp, what="intermediate_size"
        )
        self.act = get_activation(config.hidden_act)
        self.is_swiglu = config.hidden_act in ("silu", "swish")  # silu(gate) * up: one op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # strided halves of one output
        hidden = self.ops.silu_mul(gate, up) if self.is_swiglu else self.act(gate) * up
        return self.down_proj(hidden)


class Qwen2DecoderLayer(nn.Module):
    """Pre-norm block. The residual stream travels beside the layer's output, so each residual
    add happens inside the next norm (`add_and_norm`, one fused kernel with the triton ops):

        layer i:  h, s = norm_in(x + s)      (the first layer: norm_in(x), s = x)
                  h, s = norm_post(attn(h) + s)
                  return mlp(h), s           -> the next layer's x, s; the final norm adds last
    """

    def __init__(
        self,
        config: TextConfig,
        ops: LayerOps,
        attention: type[Qwen2Attention] | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        """`attention`: the attention module's class (Qwen3's for Qwen3-VL; Qwen2's default)."""
        super().__init__()
        self.self_attn = (attention or Qwen2Attention)(config, ops, tp)
        self.mlp = Qwen2MLP(config, ops, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it adds): see the class docstring."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, attn_metadata)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class Qwen2Model(nn.Module):
    """Token embedding, decoder layers and the final norm (no LM head).

    `ops` does the layers' norms, SwiGLU and rotary (chosen at start-up with the attention
    backend: `layers/fused/`); the torch reference by default. `attention` is the layers'
    attention class (Qwen3Model's differs). `tp`: this rank's group; the embedding is
    vocab-parallel, each layer holds its heads and its share of the MLP (`layers/parallel/`).
    """

    attention: type[Qwen2Attention] = Qwen2Attention

    def __init__(
        self, config: TextConfig, ops: LayerOps | None = None, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.config = config
        ops = ops or TorchLayerOps()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            [
                Qwen2DecoderLayer(config, ops, self.attention, tp)
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

        `deepstack`: the step's visual rows (None on text-only and decode steps, and always
        for Qwen2-VL / Qwen2.5-VL). Levels past the last layer are unused, as in transformers.
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
