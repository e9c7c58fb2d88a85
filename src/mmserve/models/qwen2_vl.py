"""Qwen2-VL and Qwen2.5-VL for serving: vision tower + Qwen2 decoder + LM head.

The engine's model runner drives a model with four calls:

    embeds = model.embed_multimodal(pixel_values, grid_thw)   # one [n_i, hidden] per item
    x = model.embed_input_ids(input_ids, mm_embeds, mm_index) # the splice: rows at mm_index
    hidden = model.forward(None, positions, attn_metadata, kv_caches, inputs_embeds=x)
    logits = model.compute_logits(hidden[last_token_idx])

Parameter names follow the hub checkpoint layout (`visual.*`, `model.*`, `lm_head.*`), so the
loader maps file tensors onto `state_dict()` names one to one.

An item's rows are `ModelConfig.mm_embedding_width` wide: the main embedding, then one part per
DeepStack level (Qwen3-VL, `qwen3_vl.py`; none for Qwen2-VL and Qwen2.5-VL). The splice puts the
main part at the placeholders and hands the levels to the forward that follows it: it keeps
them with their token indices (`DeepstackInputs`) and `forward` takes them, once. The runner
always calls the two in that order for one step, and a splice without images leaves nothing,
so decode and text-only steps (and the decode graphs captured over them) pay nothing. Chunked
prefill may give any subset of an item's rows: what is added is exactly the rows spliced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mmserve.errors import RequestFailedError
from mmserve.grid import grid_num_tokens
from mmserve.layers.attention import AttentionMetadata
from mmserve.layers.fused import LayerOps
from mmserve.layers.parallel import SINGLE, ParallelLMHead, TPGroup, vocab_parallel_logits
from mmserve.models.config import ModelConfig
from mmserve.models.qwen2_lm import DeepstackInputs, Qwen2Model
from mmserve.models.qwen2_vl_vision import VisionTransformer
from mmserve.models.vision_metadata import check_vision_inputs


class Qwen2VLForConditionalGeneration(nn.Module):
    """Qwen2-VL; the vision block structure (and Qwen2.5-VL windows) follows `config.vision`.
    `layer_ops` does the decoder's norms, SwiGLU and rotary (torch by default).

    `tp`: this rank's tensor-parallel group. The decoder is sharded over it (heads, MLP,
    vocab-parallel embedding and LM head: every rank gets the full logits); the vision tower is
    sharded too with `shard_vision` (`--mm-encoder-tp-mode weights`), else whole on every rank.
    ValueError naming the numbers when the group cannot split the heads or widths.
    """

    vision_tower: type[nn.Module] = VisionTransformer
    decoder: type[Qwen2Model] = Qwen2Model

    def __init__(
        self,
        config: ModelConfig,
        layer_ops: LayerOps | None = None,
        tp: TPGroup = SINGLE,
        shard_vision: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.visual = self.vision_tower(config.vision, tp=tp if shard_vision else SINGLE)
        self.model = self.decoder(config.text, layer_ops, tp)
        text = config.text
        # Tied checkpoints have no lm_head tensor: logits reuse the embedding matrix.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else ParallelLMHead(text.vocab_size, text.hidden_size, tp)
        )
        self._deepstack: DeepstackInputs | None = None  # the last splice's levels

    def embed_multimodal(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        """Encode many images / clips in one ViT call.

        pixel_values [sum(t*h*w), C*T*P*P] (items concatenated in order), grid_thw one
        (t, h, w) per item. Returns one [t*h*w / merge^2, mm_embedding_width] tensor per item.
        """
        grid_thw = check_vision_inputs(pixel_values, grid_thw, self.config.vision)
        merge = self.config.vision.spatial_merge_size
        embeds = self.visual(pixel_values, grid_thw)  # [num_patches / merge^2, width]
        sizes = [grid_num_tokens(grid, merge) for grid in grid_thw]
        return list(embeds.split(sizes))

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        mm_embeds: torch.Tensor | None = None,
        mm_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings [num_tokens, hidden]; with `mm_embeds` [num_mm, mm_embedding_width],
        row `mm_index[i]` becomes the main part of `mm_embeds[i]` (the one splice of image
        embeddings) and its DeepStack parts wait for `forward` (the module docstring).

        `mm_index` [num_mm] int64 holds flat token indices; the runner passes it, having
        matched each item's rows to the prompt's placeholders (a generated token that happens
        to be a vision id is text). Without it, every image or video placeholder id is spliced
        in order. The counts must match exactly.
        """
        self._deepstack = None
        embeds = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        if mm_embeds is None:
            return embeds
        if mm_index is None:
            is_mm = (input_ids == self.config.image_token_id) | (
                input_ids == self.config.video_token_id
            )
            mm_index = is_mm.nonzero().squeeze(1)  # [num_placeholders]
        if mm_index.shape[0] != mm_embeds.shape[0]:
            raise RequestFailedError(
                f"Attempted to assign {tuple(mm_embeds.shape)} = {mm_embeds.shape[0]} multimodal "
                f"tokens to {mm_index.shape[0]} placeholders"
            )
        hidden, width = self.config.hidden_size, self.config.mm_embedding_width
        if mm_embeds.shape[1] != width:
            raise ValueError(
                f"multimodal rows have {mm_embeds.shape[1]} values, this model's are {width} "
                f"(hidden {hidden} x (1 + {self.config.deepstack_levels} DeepStack levels))"
            )
        mm_embeds = mm_embeds.to(embeds.dtype)
        embeds[mm_index] = mm_embeds[:, :hidden]
        if self.config.deepstack_levels:
            # [num_mm, L * hidden] -> [L, num_mm, hidden]
            levels = mm_embeds[:, hidden:].reshape(-1, self.config.deepstack_levels, hidden)
            self._deepstack = DeepstackInputs(mm_index, levels.transpose(0, 1))
        return embeds

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the decoder over a flat batch; returns final-norm hidden states [num_tokens, hidden].

        input_ids [num_tokens] or inputs_embeds [num_tokens, hidden] (exactly one of them),
        positions [3, num_tokens] M-RoPE positions, kv_caches one per layer (written in place).
        The DeepStack rows of the splice that made `inputs_embeds` are added.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        deepstack, self._deepstack = self._deepstack, None
        return self.model(inputs_embeds, positions, attn_metadata, kv_caches, deepstack)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [n, hidden] -> logits [n, vocab_size] (in the model's dtype), the full
        vocabulary on every rank."""
        table = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return vocab_parallel_logits(hidden_states, table)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801
    """Qwen2.5-VL: same decoder; RMSNorm + SwiGLU ViT blocks with window attention."""

    def __init__(
        self,
        config: ModelConfig,
        layer_ops: LayerOps | None = None,
        tp: TPGroup = SINGLE,
        shard_vision: bool = False,
    ) -> None:
        if not config.vision.is_windowed:
            raise ValueError("Qwen2_5_VLForConditionalGeneration needs a qwen2_5_vl vision config")
        super().__init__(config, layer_ops, tp, shard_vision)
