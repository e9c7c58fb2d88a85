"""Value types shared by processing, scheduling and execution: multimodal items and prompts."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class PlaceholderRange:
    """Where an item's embeddings go in the prompt: `length` consecutive placeholder ids.

    `length` is the exact number of embeddings the encoder returns for the item.
    """

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    """The CPU stage's output for one image (or one video clip)."""

    pixel_values: np.ndarray  # [grid_t * grid_h * grid_w, C * T * P * P] float32
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float | None = None

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def nbytes(self) -> int:
        return int(self.pixel_values.nbytes)

    @property
    def buffer_bytes(self) -> int:
        """Bytes the pixel array keeps alive: the whole buffer it views, not just its own span."""
        root = self.pixel_values
        while isinstance(root.base, np.ndarray):
            root = root.base
        held = root.nbytes
        if root.base is not None:  # a view of a foreign buffer (bytes, mmap)
            with contextlib.suppress(TypeError):  # not a buffer: count the array alone
                held = max(held, memoryview(root.base).nbytes)
        return int(held)


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """One multimodal item of one request, as the scheduler and the runner see it.

    `identifier` is the item's full-width identity digest (see `mmserve.hashing`): the key of
    the encoder cache and part of every KV block hash that overlaps the item. `data` is None
    only when the caller named an item by UUID that is already cached in its namespace.
    """

    identifier: str
    modality: str
    placeholder: PlaceholderRange
    data: ProcessedImage | None
    grid_thw: tuple[int, int, int]

    @property
    def num_embeds(self) -> int:
        return self.placeholder.length


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt ready for the engine: token ids with expanded placeholders, items and positions."""

    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    mrope_positions: np.ndarray | None = None  # [3, num_prompt_tokens] int64
    mrope_position_delta: int = 0
    prompt: str | None = None
