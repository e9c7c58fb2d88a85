"""The encoder's device stage: one call of the vision tower per batch of processed images."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmserve.disaggregation.embedding_cache import CachedEmbedding
from mmserve.disaggregation.embedding_dtypes import DTYPE_NAMES
from mmserve.execution.encoder.normalize import PixelNormalizer
from mmserve.grid import grid_num_tokens
from mmserve.models.qwen2_vl_vision import VisionTransformer
from mmserve.models.vision_metadata import check_vision_inputs
from mmserve.multimodal import EncoderInput


class VisionStage:
    """Runs the vision tower alone (no language model on this server) on `device` in `dtype`;
    embeddings come back to the host as the bytes that are sent.

    `embedding_width` is the width of the tower's output rows (`ModelConfig.mm_embedding_width`:
    the main embedding then every DeepStack level), what the rows sent are checked against.
    """

    def __init__(
        self,
        tower: VisionTransformer,
        device: torch.device,
        dtype: torch.dtype,
        *,
        embedding_width: int,
    ) -> None:
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"the encoder runs in float32, bfloat16 or float16, not {dtype}")
        self.tower = tower
        self.device = device
        self.dtype = dtype
        self.dtype_name = DTYPE_NAMES[dtype]
        self.embedding_width = embedding_width
        self.merge = tower.config.spatial_merge_size
        self._normalize = PixelNormalizer(device, dtype)

    def encode(self, images: Sequence[EncoderInput]) -> list[CachedEmbedding]:
        """One forward over all `images` (attention never crosses items); blocks the caller."""
        grids = [tuple(img.grid_thw) for img in images]
        # uint8 levels -> [total_patches, C * T * P * P] in dtype, the items in order
        pixels = self._normalize(images)
        checked = check_vision_inputs(pixels, grids, self.tower.config)
        with torch.inference_mode():
            embeds = self.tower(pixels, checked)  # [total_patches / merge^2, embedding_width]
        if embeds.shape[-1] != self.embedding_width:  # a bug: the LM would refuse every row
            raise RuntimeError(
                f"the vision tower returned rows of width {embeds.shape[-1]}, the model's are "
                f"{self.embedding_width} wide"
            )
        sizes = [grid_num_tokens(grid, self.merge) for grid in checked]
        host = embeds.to("cpu").contiguous()
        out = []
        for grid, emb in zip(checked, host.split(sizes), strict=True):
            data = emb.contiguous().view(torch.uint8).numpy().tobytes()
            out.append(CachedEmbedding(data, self.dtype_name, tuple(emb.shape), grid))  # type: ignore[arg-type]
        return out
