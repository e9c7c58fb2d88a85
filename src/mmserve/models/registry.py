"""Which model class serves which `config.architectures` entry."""

from __future__ import annotations

from torch import nn

from mmserve.models.config import QWEN2_5_VL, QWEN2_VL, QWEN3_VL
from mmserve.models.qwen2_vl import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
)
from mmserve.models.qwen3_vl import Qwen3VLForConditionalGeneration

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    QWEN2_VL: Qwen2VLForConditionalGeneration,
    QWEN2_5_VL: Qwen2_5_VLForConditionalGeneration,
    QWEN3_VL: Qwen3VLForConditionalGeneration,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"no model class for architecture {architecture!r}; "
            f"supported: {', '.join(MODEL_REGISTRY)}"
        ) from None
