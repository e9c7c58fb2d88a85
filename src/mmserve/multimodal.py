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


REMOTE_SOURCES = ("bytes", "rgb", "url")


@dataclass(frozen=True, slots=True)
class RemoteItem:
    """An image the remote encoder pool encodes: where its bytes are and what the LM planned.

    The language-model side never decodes it: it planned the grid from the image header
    (inline bytes) or from the pool's plan answer (a URL), and the pool must reach the same
    grid and the same content digest or fail the item.
    """

    source: str  # "bytes" (an image file), "rgb" (uint8 [H, W, 3], C order) or "url"
    payload: bytes | None  # the file or array bytes; None for "url"
    url: str | None
    rgb_size: tuple[int, int] | None  # (width, height) of an "rgb" payload
    min_pixels: int
    max_pixels: int
    grid_thw: tuple[int, int, int]
    content_digest: str  # blake3 hex of the payload, or of the URL's bytes as planned

    def __post_init__(self) -> None:
        if self.source not in REMOTE_SOURCES:
            raise ValueError(f"remote item source {self.source!r} is not one of {REMOTE_SOURCES}")
        if (self.source == "url") != (self.payload is None) or (self.source == "url") != (
            self.url is not None
        ):
            raise ValueError("a remote item has a payload, or (source 'url') a URL, not both")
        if (self.source == "rgb") != (self.rgb_size is not None):
            raise ValueError("rgb_size is given exactly for an 'rgb' remote item")
        if self.source == "rgb":
            assert self.rgb_size is not None and self.payload is not None
            w, h = self.rgb_size
            if w <= 0 or h <= 0 or len(self.payload) != w * h * 3:
                raise ValueError(f"an rgb payload of {w}x{h} holds {w * h * 3} bytes")

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def nbytes(self) -> int:
        """Bytes shipped to the pool for it (0 for a URL: the pool fetches it)."""
        return 0 if self.payload is None else len(self.payload)


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """One multimodal item of one request, as the scheduler and the runner see it.

    `identifier` is the item's full-width identity digest (see `mmserve.hashing`): the key of
    the encoder cache and part of every KV block hash that overlaps the item. `data` is None
    only when the caller named an item by UUID that is already cached in its namespace; a
    `RemoteItem` when the remote encoder pool encodes it (a disaggregated server).
    """

    identifier: str
    modality: str
    placeholder: PlaceholderRange
    data: ProcessedImage | RemoteItem | None
    grid_thw: tuple[int, int, int]

    @property
    def num_embeds(self) -> int:
        return self.placeholder.length

    @property
    def num_patches(self) -> int:
        """Input patches the vision tower reads for this item (what its activations scale with)."""
        t, h, w = self.grid_thw
        return t * h * w


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt ready for the engine: token ids with expanded placeholders, items and positions."""

    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    mrope_positions: np.ndarray | None = None  # [3, num_prompt_tokens] int64
    mrope_position_delta: int = 0
    prompt: str | None = None
