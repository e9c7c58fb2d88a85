"""What every wire message shares: the error, the base struct, field types and shared parts."""

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
PosInt = Annotated[int, msgspec.Meta(ge=1)]
# A vocabulary index: bounded so that no id overflows the int32/int64 tensors it indexes.
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
RequestId = Annotated[str, msgspec.Meta(min_length=1)]
Identifier = Annotated[str, msgspec.Meta(min_length=1)]
GridTHW = tuple[PosInt, PosInt, PosInt]
FailureKind = Literal["request", "internal", "unavailable"]
FinishReason = Literal["stop", "length", "abort", "error"]

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


class WireRemoteItem(WireStruct):
    """`multimodal.RemoteItem`: an image the encoder pool encodes, with what the LM planned.

    `payload` (uint8 [num_bytes]: the image file, or an "rgb" item's HxWx3 array) travels as
    a raw frame like pixels, never inside the msgpack body; None for a "url" item.
    """

    source: Literal["bytes", "rgb", "url"]
    payload: np.ndarray | None
    url: str | None
    rgb_size: tuple[PosInt, PosInt] | None
    min_pixels: PosInt
    max_pixels: PosInt
    grid_thw: GridTHW
    content_digest: Annotated[str, msgspec.Meta(min_length=1)]

    def __post_init__(self) -> None:
        payload = self.payload
        if payload is not None and (payload.dtype != np.uint8 or payload.ndim != 1):
            raise WireError(
                f"remote item: payload is {payload.dtype} {payload.shape}, expected uint8 "
                "[num_bytes]"
            )


class WireStructuredOutputs(WireStruct):
    """`StructuredOutputParams`: the grammar's kind and its text (compiled on each side)."""

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    spec: str = ""


class WireSamplingParams(WireStruct):
    """`SamplingParams` as plain fields: a seed travels, a random generator never does."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[TokenId, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: WireStructuredOutputs | None = None
    logprobs: NonNegInt | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[TokenId, float] | None = None


class WireLogprobs(WireStruct):
    """`scheduling.outputs.Logprobs` as arrays: one row per token, column 0 the sampled one.

    token_ids int32 [num_tokens, 1 + K], logprobs float32 [num_tokens, 1 + K], ranks int32
    [num_tokens].
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray

    def __post_init__(self) -> None:
        ids, values, ranks = self.token_ids, self.logprobs, self.ranks
        if ids.dtype != np.int32 or values.dtype != np.float32 or ranks.dtype != np.int32:
            raise WireError(
                f"logprobs: dtypes {ids.dtype}, {values.dtype}, {ranks.dtype}; expected "
                "int32 token_ids, float32 logprobs, int32 ranks"
            )
        if ids.ndim != 2 or ids.shape[1] < 1 or values.shape != ids.shape:
            raise WireError(
                f"logprobs: token_ids {ids.shape} and logprobs {values.shape} must be the same "
                "[num_tokens, 1 + K]"
            )
        if ranks.shape != (ids.shape[0],):
            raise WireError(f"logprobs: ranks {ranks.shape}, expected ({ids.shape[0]},)")
        if ids.size and (int(ids.min()) < 0 or int(ranks.min()) < 1):
            raise WireError("logprobs: token ids must be >= 0 and ranks >= 1")


class WireRequestFailure(WireStruct):
    """Why the engine ended one request with an error, and whose fault it is.

    kind "request": the request's own content or parameters (answered 4xx, `param` names the
    field where one exists); "internal": the server failed (answered 500).
    """

    message: str
    kind: FailureKind
    param: str | None = None


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
