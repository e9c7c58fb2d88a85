"""What the envelopes share: the error, the base struct, field types and the item parts."""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec
import numpy as np


class WireError(ValueError):
    """A message could not be encoded or decoded: the text says which part is wrong and why."""


class WireStruct(
    msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True, gc=False
):
    """Base of every wire message: immutable, encoded as a msgpack array in field order.

    `array_like` keeps field names off the wire (a message is a positional array) and
    `forbid_unknown_fields` makes an array longer than the struct a decode error, not a
    silently dropped tail. `gc=False`: messages are trees, they never hold a cycle.
    """


# Field types: msgspec checks these bounds on decode (never on encode).
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
# A vocabulary index: bounded so that no id overflows the int32/int64 tensors it indexes.
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
RequestId = Annotated[str, msgspec.Meta(min_length=1)]
Identifier = Annotated[str, msgspec.Meta(min_length=1)]
GridTHW = tuple[PosInt, PosInt, PosInt]

_PIXEL_KINDS = "f"  # encoder inputs are floating point (float16/32/64)


class WireMMFeature(WireStruct):
    """One multimodal item as the scheduler and the runner see it: never its pixels.

    `identifier` is the item's identity digest (the encoder-cache key, part of KV block
    hashes); its embeddings fill prompt positions [offset, offset + length).
    """

    identifier: Identifier
    modality: str
    offset: NonNegInt
    length: PosInt
    grid_thw: GridTHW

    @property
    def end(self) -> int:
        return self.offset + self.length


class WireEncoderInput(WireStruct):
    """What whoever encodes one item needs, and nothing else: travels only towards an encoder.

    pixel_values: [grid_t * grid_h * grid_w, C * T * P * P], floating point.
    `second_per_grid_t`: a video's seconds per temporal patch (None for an image); the
    engine's positions already include it, it travels so that the item arrives whole.
    """

    identifier: Identifier
    modality: str
    grid_thw: GridTHW
    pixel_values: np.ndarray
    second_per_grid_t: float | None = None

    def __post_init__(self) -> None:
        pixels = self.pixel_values
        num_patches = math.prod(self.grid_thw)
        if pixels.ndim != 2 or pixels.shape[0] != num_patches:
            raise WireError(
                f"encoder input {self.identifier[:16]}: pixel_values has shape {pixels.shape}, "
                f"expected [{num_patches}, patch_dim] for grid_thw {tuple(self.grid_thw)}"
            )
        if pixels.dtype.kind not in _PIXEL_KINDS:
            raise WireError(
                f"encoder input {self.identifier[:16]}: pixel_values has dtype {pixels.dtype}, "
                "expected a floating-point dtype"
            )
        seconds = self.second_per_grid_t
        if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
            raise WireError(
                f"encoder input {self.identifier[:16]}: second_per_grid_t is {seconds}, "
                "expected a finite number > 0 (or null for an image)"
            )


RemoteSource = Literal["bytes", "rgb", "url"]
Size = tuple[PosInt, PosInt]


class WireRemoteItem(WireStruct):
    """A `RemoteItem` (an image the encoder pool encodes) on its way towards the pool's client.

    `payload`: the image file ("bytes") or the packed uint8 [H, W, 3] array ("rgb") as a uint8
    [nbytes] array, so it travels as a raw frame of its own (the frame index is its array
    reference), never inside msgpack; None for a "url" item. The other fields are
    RemoteItem's.
    """

    identifier: Identifier
    source: RemoteSource
    payload: np.ndarray | None
    url: str | None
    rgb_size: Size | None  # (width, height) of an "rgb" payload
    min_pixels: PosInt
    max_pixels: PosInt
    grid_thw: GridTHW
    content_digest: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]

    def __post_init__(self) -> None:
        owner = f"remote item {self.identifier[:16]}"
        payload = self.payload
        if payload is not None and (payload.dtype != np.uint8 or payload.ndim != 1):
            raise WireError(f"{owner}: payload is {payload.dtype} {payload.shape}, not uint8 [n]")
        if (self.source == "url") != (payload is None) or (self.source == "url") != (
            self.url is not None
        ):
            raise WireError(f"{owner}: a {self.source!r} item carries a payload or a URL, not both")
        if (self.source == "rgb") != (self.rgb_size is not None):
            raise WireError(f"{owner}: rgb_size comes exactly with an 'rgb' payload")
        if self.rgb_size is not None and payload is not None:
            w, h = self.rgb_size
            if payload.size != w * h * 3:
                raise WireError(
                    f"{owner}: an rgb payload of {w}x{h} holds {w * h * 3} bytes, not "
                    f"{payload.size}"
                )
        if self.min_pixels > self.max_pixels:
            raise WireError(f"{owner}: min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")


def check_positions(positions: np.ndarray, num_tokens: int, owner: str) -> None:
    """M-RoPE positions must be int64 [3, num_tokens]: the runner slices them by token index."""
    if positions.dtype != np.int64 or positions.shape != (3, num_tokens):
        raise WireError(
            f"{owner}: mrope_positions is {positions.dtype} {positions.shape}, "
            f"expected int64 (3, {num_tokens})"
        )


def check_features(features: list[WireMMFeature], num_tokens: int, owner: str) -> None:
    """Every item's placeholder range must lie inside the prompt it belongs to."""
    for f in features:
        if f.end > num_tokens:
            raise WireError(
                f"{owner}: item {f.identifier[:16]} covers positions [{f.offset}, {f.end}) "
                f"but the prompt has {num_tokens} tokens"
            )
