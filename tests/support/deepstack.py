"""DeepStack widths without a DeepStack model: a Qwen2-VL config that declares DeepStack levels,
and a vision tower whose output rows carry them, for testing what sizes, sends and counts
encoder outputs (the model itself is Qwen3-VL's to test)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mmserve.models.config import ModelConfig, VisionConfig


def with_deepstack_levels(config: ModelConfig, levels: int) -> ModelConfig:
    """`config` with `levels` DeepStack levels declared (taps on its first `levels` vision
    blocks, so at most its depth): its encoder output rows are hidden x (1 + levels) wide
    (`mm_embedding_width`)."""
    assert levels <= config.vision.depth, f"a depth-{config.vision.depth} tower has no {levels}"
    vision = dataclasses.replace(config.vision, deepstack_visual_indexes=tuple(range(levels)))
    return dataclasses.replace(config, vision=vision)


class DeepStackTower(nn.Module):
    """A real vision tower whose rows are widened as a DeepStack tower's are: the main embedding,
    then level i (0-based) = the main embedding x (i + 2), concatenated along the last dim.

    Known values per level, so a test can check that every level crossed whole and in order.
    """

    def __init__(self, tower: nn.Module, levels: int) -> None:
        super().__init__()
        self.tower = tower
        self.levels = levels
        self.config: VisionConfig = dataclasses.replace(
            tower.config, deepstack_visual_indexes=tuple(range(levels))
        )

    def forward(self, pixels: torch.Tensor, grid_thw: object) -> torch.Tensor:
        main = self.tower(pixels, grid_thw)  # [num_tokens, hidden]
        levels = [main * (i + 2) for i in range(self.levels)]
        return torch.cat([main, *levels], dim=-1)  # [num_tokens, hidden * (1 + levels)]
