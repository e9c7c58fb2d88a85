"""Qwen3-VL (dense) for serving: Qwen3-VL vision tower + Qwen3 decoder with DeepStack + LM head.

The model runner drives it with the same four calls as Qwen2-VL (`qwen2_vl.py`). What differs
is the width of an item's rows: `[main | level 0 | level 1 | ...]`, `hidden * (1 + levels)`
(`ModelConfig.mm_embedding_width`); only this class splits them.

    embeds = model.embed_multimodal(pixel_values, grid_thw)    # one [n_i, hidden * (1 + L)]
    x = model.embed_input_ids(input_ids, mm_embeds, mm_index)  # main part spliced at mm_index
    hidden = model.forward(None, positions, attn_metadata, kv_caches, inputs_embeds=x)
    logits = model.compute_logits(hidden[last_token_idx])

NOTE: the splice hands the DeepStack parts to the forward that follows it. `embed_input_ids`
keeps them with their token indices (`DeepstackInputs`) and `forward` takes them (once): the
runner always calls the two in that order for one step, and an `embed_input_ids` without
images leaves nothing, so decode and text-only steps (and the decode graphs captured over
them) pay nothing. Chunked prefill may give any subset of an item's rows: what is added is
exactly the rows the step spliced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mmserve.errors import RequestFailedError
from mmserve.grid import grid_num_tokens
from mmserve.layers.attention import AttentionMetadata
from mmserve.layers.fused import LayerOps
from mmserve.models.config import ModelConfig
from mmserve.models.qwen3_lm import DeepstackInputs, Qwen3Model
from mmserve.models.qwen3_vl_vision import Qwen3VisionTransformer
from mmserve.models.vision_metadata import check_vision_inputs


class Qwen3VLForConditionalGeneration(nn.Module):
    """Qwen3-VL dense (2B / 4B / 8B / 32B); `layer_ops` as in Qwen2-VL (torch by default)."""

    def __init__(self, config: ModelConfig, layer_ops: LayerOps | None = None) -> None:
        super().__init__()
        self.config = config
        self.visual = Qwen3VisionTransformer(config.vision)
        self.model = Qwen3Model(config.text, layer_ops)
        # Tied checkpoints (the small sizes) have no lm_head tensor: logits reuse the embedding.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        )
        self._deepstack: DeepstackInputs | None = None

    def embed_multimodal(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        """Encode many images / clips in one ViT call: one [t*h*w / merge^2, hidden * (1 + L)]
        tensor per item (pixel_values and grid_thw as in Qwen2-VL)."""
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
        """Token embeddings [num_tokens, hidden]; with `mm_embeds` [num_mm, hidden * (1 + L)],
        row `mm_index[i]` becomes the main part of `mm_embeds[i]` and the L DeepStack parts wait
        for `forward` (see the module docstring). `mm_index` as in Qwen2-VL."""
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

        As in Qwen2-VL; the DeepStack rows of the splice that made `inputs_embeds` are added.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        deepstack, self._deepstack = self._deepstack, None
        return self.model(inputs_embeds, positions, attn_metadata, kv_caches, deepstack)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [n, hidden] -> logits [n, vocab_size] (in the model's dtype)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return hidden_states @ weight.t()
