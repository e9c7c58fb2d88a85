"""Value types shared by processing, scheduling, execution and the wire: multimodal items.

An item is two values: its spec (`MultiModalFeature`: identity, modality, placeholder, grid;
what the scheduler sees) and its data (`EncoderInput` pixels for the local vision tower, or a
`RemoteItem` for the encoder pool). They are frozen msgspec structs, the same types in-process
and on the wire; their checks run on construction and on decode.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec
import numpy as np

from mmserve.grid import grid_num_patches

_NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
_PosInt = Annotated[int, msgspec.Meta(ge=1)]
GridTHW = tuple[_PosInt, _PosInt, _PosInt]
Identifier = Annotated[str, msgspec.Meta(min_length=1)]


class _Item(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True, gc=False):
    """Base of the item types: immutable, a positional array on the wire."""


class PlaceholderRange(_Item):
    """Where an item's embeddings go in the prompt: `length` consecutive placeholder ids.

    `length` is the exact number of embeddings the encoder returns for the item.
    """

    offset: _NonNegInt
    length: _PosInt

    @property
    def end(self) -> int:
        return self.offset + self.length


class MultiModalFeature(_Item):
    """One multimodal item of one request as the scheduler and the runner see it: never pixels.

    `identifier` is the item's full-width identity digest (see `mmserve.hashing`): the key of
    the encoder cache and part of every KV block hash that overlaps the item. `is_remote`: the
    remote encoder pool encodes it (a disaggregated server), not the local vision tower.
    """

    identifier: Identifier
    modality: str
    placeholder: PlaceholderRange
    grid_thw: GridTHW
    is_remote: bool = False

    @property
    def num_embeds(self) -> int:
        return self.placeholder.length

    @property
    def num_patches(self) -> int:
        """Input patches the vision tower reads for this item (what its activations scale with)."""
        return grid_num_patches(self.grid_thw)


NormalizationOrder = Literal["rescale_then_normalize", "normalize_scaled"]
NORMALIZATION_ORDERS = ("rescale_then_normalize", "normalize_scaled")


class PixelNormalization(_Item):
    """How a uint8 patch value becomes the float the vision tower reads: the checkpoint's
    rescale and per-channel normalisation (preprocessor_config.json), in the float order of the
    processor it reproduces, so that the engine's floats are bit-identical to transformers':

        rescale_then_normalize (images): x = float32(level * rescale_factor in float64), then
                                          (x - mean) / std in float32
        normalize_scaled       (videos): (level - mean / r) / (std / r) in float32

    The CPU stage ships uint8 patches (1 byte per value) and this; the engine applies it on
    the device (`value_table`), where the first vision layer reads the result.
    """

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale_factor: float
    do_rescale: bool
    do_normalize: bool
    order: NormalizationOrder

    def __post_init__(self) -> None:
        if self.order not in NORMALIZATION_ORDERS:
            raise ValueError(
                f"normalization order {self.order!r} is not one of {NORMALIZATION_ORDERS}"
            )
        if len(self.mean) != 3 or len(self.std) != 3 or any(s == 0 for s in self.std):
            raise ValueError(f"mean and std need 3 entries and no zero std, got {self}")
        values = (*self.mean, *self.std, self.rescale_factor)
        if not all(math.isfinite(v) for v in values) or self.rescale_factor <= 0:
            raise ValueError(f"normalization values must be finite (rescale > 0), got {self}")

    def value_table(self) -> np.ndarray:
        """[3, 256] float32: the value of every uint8 level, per channel."""
        if self.order == "rescale_then_normalize":
            levels = np.arange(256, dtype=np.float64)
            if self.do_rescale:
                levels = levels * self.rescale_factor
            table = np.broadcast_to(levels.astype(np.float32), (3, 256))
            if self.do_normalize:
                mean = np.asarray(self.mean, dtype=np.float32)[:, None]
                std = np.asarray(self.std, dtype=np.float32)[:, None]
                table = (table - mean) / std
            return np.ascontiguousarray(table, dtype=np.float32)
        table = np.broadcast_to(np.arange(256, dtype=np.float32), (3, 256))
        if self.do_normalize:
            scale = np.float32(1.0 / self.rescale_factor) if self.do_rescale else np.float32(1.0)
            mean = (np.asarray(self.mean, dtype=np.float32) * scale)[:, None]
            std = (np.asarray(self.std, dtype=np.float32) * scale)[:, None]
            table = (table - mean) / std
        elif self.do_rescale:
            table = table * np.float32(self.rescale_factor)
        return np.ascontiguousarray(table, dtype=np.float32)

    def apply(self, levels: np.ndarray) -> np.ndarray:
        """uint8 patches [n, C * T * P * P] (channel-major rows) -> float32, on the host: the
        reference for the engine's device path, and what tests compare with transformers."""
        assert levels.dtype == np.uint8 and levels.ndim == 2, (levels.dtype, levels.shape)
        per_channel = levels.shape[1] // 3
        offsets = np.repeat(np.arange(3, dtype=np.intp) * 256, per_channel)  # [C*T*P*P]
        return self.value_table().ravel()[levels + offsets]


class EncoderInput(_Item):
    """What the vision tower reads for one image (or one video clip): the CPU stage's output.

    pixel_values: [grid_t * grid_h * grid_w, C * T * P * P] uint8 levels, each row channel-major
    ([C, T, P, P] flattened); it travels as a raw frame. `normalization` turns the levels into
    the tower's floats on the engine side (a quarter of float32's bytes on the wire, in the
    processor cache and in every item accounting until then). `second_per_grid_t`: a video's
    seconds per temporal patch (None for an image); the prompt's positions already include it.
    """

    pixel_values: np.ndarray  # [grid_t * grid_h * grid_w, C * T * P * P] uint8
    grid_thw: GridTHW
    normalization: PixelNormalization
    second_per_grid_t: float | None = None

    def __post_init__(self) -> None:
        pixels = self.pixel_values
        num_patches = grid_num_patches(self.grid_thw)
        if pixels.ndim != 2 or pixels.shape[0] != num_patches or pixels.shape[1] % 3:
            raise ValueError(
                f"pixel_values has shape {pixels.shape}, expected [{num_patches}, patch_dim] "
                f"(patch_dim a multiple of 3 channels) for grid_thw {tuple(self.grid_thw)}"
            )
        if pixels.dtype != np.uint8:
            raise ValueError(
                f"pixel_values has dtype {pixels.dtype}, expected uint8 levels (the engine "
                "normalises them; float patches are not accepted)"
            )
        seconds = self.second_per_grid_t
        if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(
                f"second_per_grid_t is {seconds}, expected a finite number > 0 (None: an image)"
            )

    def normalized(self) -> np.ndarray:
        """float32 [num_patches, C * T * P * P]: the values the vision tower reads."""
        return self.normalization.apply(self.pixel_values)

    @property
    def num_patches(self) -> int:
        return grid_num_patches(self.grid_thw)

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
RemoteSource = Literal["bytes", "rgb", "url"]


class RemoteItem(_Item):
    """An image the remote encoder pool encodes: where its bytes are and what the LM planned.

    The language-model side never decodes it: it planned the grid from the image header
    (inline bytes) or from the pool's plan answer (a URL), and the pool must reach the same
    grid and the same content digest or fail the item. `payload` is the image file ("bytes")
    or the packed uint8 [H, W, 3] array ("rgb") as a uint8 [nbytes] array (bytes given are
    viewed as one, no copy), so that it travels as a raw frame; None for "url".
    """

    source: RemoteSource
    payload: np.ndarray | None  # uint8 [nbytes]
    url: str | None
    rgb_size: tuple[_PosInt, _PosInt] | None  # (width, height) of an "rgb" payload
    min_pixels: _PosInt
    max_pixels: _PosInt
    grid_thw: GridTHW
    content_digest: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]

    def __post_init__(self) -> None:
        if isinstance(self.payload, bytes | bytearray | memoryview):
            msgspec.structs.force_setattr(
                self, "payload", np.frombuffer(self.payload, dtype=np.uint8)
            )
        payload = self.payload
        if self.source not in REMOTE_SOURCES:
            raise ValueError(f"remote item source {self.source!r} is not one of {REMOTE_SOURCES}")
        if payload is not None and (payload.dtype != np.uint8 or payload.ndim != 1):
            raise ValueError(
                f"a remote item's payload is {payload.dtype} {payload.shape}, not uint8 [n]"
            )
        if (self.source == "url") != (payload is None) or (self.source == "url") != (
            self.url is not None
        ):
            raise ValueError(f"a {self.source!r} remote item carries a payload or a URL, not both")
        if (self.source == "rgb") != (self.rgb_size is not None):
            raise ValueError("rgb_size comes exactly with an 'rgb' payload")
        if self.rgb_size is not None and payload is not None:
            w, h = self.rgb_size
            if w <= 0 or h <= 0 or payload.size != w * h * 3:
                raise ValueError(f"an rgb payload of {w}x{h} holds {w * h * 3} bytes")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")

    @property
    def num_patches(self) -> int:
        return grid_num_patches(self.grid_thw)

    @property
    def nbytes(self) -> int:
        """Bytes shipped to the pool for it (0 for a URL: the pool fetches it)."""
        return 0 if self.payload is None else int(self.payload.nbytes)

    @property
    def payload_bytes(self) -> memoryview:
        """The payload as a byte buffer (a view, no copy); empty for a URL item."""
        return memoryview(b"") if self.payload is None else self.payload.data


ItemData = EncoderInput | RemoteItem


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt ready for the engine: token ids with expanded placeholders, item specs, their
    data by identifier, and positions.

    `mm_data` lacks an item only when the caller named it by UUID and it is already cached in
    its namespace (the engine holds its embeddings).
    """

    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    mrope_positions: np.ndarray | None = None  # [3, num_prompt_tokens] int64
    mrope_position_delta: int = 0
    prompt: str | None = None
    mm_data: dict[str, ItemData] = field(default_factory=dict)
