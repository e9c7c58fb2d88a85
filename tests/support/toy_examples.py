"""Held-out questions for the bundled toy model, drawn from the training script's generator with
a seed of their own (the training stream never produces them), as OpenAI-style messages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image
from scripts.toy_data import (
    EXTRA_TASKS,
    ONE_IMAGE_TASKS,
    TASKS,
    TWO_IMAGE_TASKS,
    accuracy_target,
    draw,
    sample_example,
)

__all__ = [
    "EXTRA_TASKS",
    "ONE_IMAGE_TASKS",
    "TASKS",
    "TWO_IMAGE_TASKS",
    "ToyQuestion",
    "accuracy_target",
    "held_out",
]

HELD_OUT_SEED = 20261130


@dataclass(frozen=True)
class ToyQuestion:
    task: str
    images: tuple[Image.Image, ...]
    question: str
    answer: str
    system: str | None

    def messages(self, image_parts: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Chat messages; `image_parts` replaces the default PIL image parts (e.g. data URLs)."""
        parts = image_parts or [{"type": "image", "image": img} for img in self.images]
        msgs: list[dict[str, Any]] = [
            {"role": "user", "content": [*parts, {"type": "text", "text": self.question}]}
        ]
        if self.system is not None:
            msgs.insert(0, {"role": "system", "content": self.system})
        return msgs


def held_out(task: str, num: int, seed: int = HELD_OUT_SEED) -> list[ToyQuestion]:
    rng = np.random.default_rng([seed, TASKS.index(task)])
    out = []
    for _ in range(num):
        ex = sample_example(rng, task)
        images = tuple(draw(p) for p in ex.pictures)
        out.append(ToyQuestion(task, images, ex.question, ex.answer, ex.system))
    return out
