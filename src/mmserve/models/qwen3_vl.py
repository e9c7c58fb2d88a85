"""Qwen3-VL (dense) for serving: Qwen3-VL vision tower + Qwen3 decoder with DeepStack + LM head.

The model runner drives it with the same four calls as Qwen2-VL, and the same class does the
work (`qwen2_vl.py`): what differs is the tower (`qwen3_vl_vision.py`: patch 16, the learned
position table, DeepStack mergers), the decoder's attention (`qwen3_lm.py`) and the width of an
item's rows, `[main | level 0 | level 1 | ...]` = hidden * (1 + levels)
(`ModelConfig.mm_embedding_width`), which the splice splits.
"""

from __future__ import annotations

from mmserve.models.qwen2_vl import Qwen2VLForConditionalGeneration
from mmserve.models.qwen3_lm import Qwen3Model
from mmserve.models.qwen3_vl_vision import Qwen3VisionTransformer


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen3-VL dense (2B / 4B / 8B / 32B); `layer_ops` as in Qwen2-VL (torch by default). Tied
    checkpoints (the small sizes) have no lm_head tensor."""

    vision_tower = Qwen3VisionTransformer
    decoder = Qwen3Model
