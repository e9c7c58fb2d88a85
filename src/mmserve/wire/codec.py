"""Frames of a wire message: a 3-byte header and a msgpack body, then one raw frame per array.

```
frame 0   | magic | version | tag | msgpack body (the struct as a positional array) |
frame 1.. | the raw bytes of each array, C order, in the order the body references them   |
```

An array in the body is `[dtype, shape, frame_idx]`; decoding wraps its frame with
`np.frombuffer`, so arrays come back as read-only views over the received frames. Nothing here
pickles: the only objects that travel are msgpack values and raw array bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import msgspec
import numpy as np

from mmserve.wire.common import WireError
from mmserve.wire.engine_core import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreShutdown,
    EngineDead,
)
from mmserve.wire.executor import (
    WorkerAddItems,
    WorkerFailed,
    WorkerFreeItems,
    WorkerReady,
    WorkerShutdown,
    WorkerStep,
    WorkerStepDone,
)

MAGIC = 0xB5  # any other first byte is not ours
VERSION = 5  # 5: EncoderInput carries uint8 levels and their PixelNormalization
HEADER_BYTES = 3
MAX_NDIM = 8

Message = (
    EngineCoreRequest
    | EngineCoreAbort
    | EngineCoreShutdown
    | EngineCoreOutputs
    | EngineDead
    | EngineCoreReady
    | WorkerAddItems
    | WorkerFreeItems
    | WorkerStep
    | WorkerShutdown
    | WorkerReady
    | WorkerStepDone
    | WorkerFailed
)
Frame = bytes | bytearray | memoryview

# Tags group by direction: 1.. API -> engine core, 16.. engine core -> API (17 was the stats
# of an older version: they ride in EngineCoreOutputs), 32.. executor -> tensor-parallel
# workers, 48.. workers -> executor.
MESSAGE_TAGS: MappingProxyType[type, int] = MappingProxyType(
    {
        EngineCoreRequest: 1,
        EngineCoreAbort: 2,
        EngineCoreShutdown: 3,
        EngineCoreOutputs: 16,
        EngineDead: 18,
        EngineCoreReady: 19,
        WorkerAddItems: 32,
        WorkerFreeItems: 33,
        WorkerStep: 34,
        WorkerShutdown: 35,
        WorkerReady: 48,
        WorkerStepDone: 49,
        WorkerFailed: 50,
    }
)
_TYPES_BY_TAG = MappingProxyType({tag: t for t, tag in MESSAGE_TAGS.items()})
# Plain numeric dtypes only, little-endian: never object arrays (numpy would pickle them).
ALLOWED_DTYPES: MappingProxyType[str, np.dtype] = MappingProxyType(
    {
        s: np.dtype(s)
        for s in ("|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8")
        + ("<f2", "<f4", "<f8")
    }
)


def encode(msg: Message) -> list[Frame]:
    """The frames of one message: frame 0 is header + body, then one frame per array.

    Array frames are zero-copy memoryviews of the message's arrays (a copy only for an array
    that is not C-contiguous little-endian): do not write to those arrays until the frames
    are sent.
    """
    tag = MESSAGE_TAGS.get(type(msg))
    if tag is None:
        raise WireError(f"{type(msg).__name__} is not a wire message; send one of {_names()}")
    frames: list[Frame] = [b""]

    def enc_hook(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return _array_ref(obj, frames)
        if isinstance(obj, np.generic) and obj.dtype.kind in "biuf":
            return obj.item()  # a numpy scalar among plain ints or floats
        raise TypeError(f"{type(obj).__name__} values cannot travel on the wire")

    try:
        body = msgspec.msgpack.Encoder(enc_hook=enc_hook).encode(msg)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"cannot encode {type(msg).__name__}: {exc}") from exc
    frames[0] = bytes((MAGIC, VERSION, tag)) + body
    return frames


def decode(frames: Sequence[Any]) -> Message:
    """The message in `frames` (bytes, memoryviews, zmq frames: anything with a buffer).

    Raises WireError, and nothing else, for anything that is not a well-formed message of a
    known type: bad header, truncated or mistyped body, an array reference that does not
    match its frame, a frame too many or too few, a field that breaks its bounds.
    """
    if not frames:
        raise WireError("no frames: a message has at least its header frame")
    views = [_byte_view(frame, i) for i, frame in enumerate(frames)]
    head = views[0]
    if head.nbytes < HEADER_BYTES:
        raise WireError(f"header frame has {head.nbytes} bytes, needs at least {HEADER_BYTES}")
    if head[0] != MAGIC:
        raise WireError(f"frame 0 starts with byte {head[0]:#04x}, not {MAGIC:#04x}: not ours")
    if head[1] != VERSION:
        raise WireError(f"wire version {head[1]} is not {VERSION}: both sides must match")
    msg_type = _TYPES_BY_TAG.get(head[2])
    if msg_type is None:
        raise WireError(f"unknown message tag {head[2]}")
    next_frame = [1]

    def dec_hook(type_: type, obj: Any) -> Any:
        if type_ is np.ndarray:
            return _array_from_ref(obj, views, next_frame)
        # Only ndarray fields reach this hook; msgspec turns the TypeError into a DecodeError.
        raise TypeError(f"no wire decoding for {type_!r}")

    try:
        msg = msgspec.msgpack.Decoder(msg_type, dec_hook=dec_hook).decode(head[HEADER_BYTES:])
    except (msgspec.DecodeError, RecursionError) as exc:
        raise WireError(f"malformed {msg_type.__name__}: {exc}") from exc
    if next_frame[0] != len(views):
        raise WireError(
            f"{msg_type.__name__} references {next_frame[0] - 1} array frames but "
            f"{len(views) - 1} came with it"
        )
    return msg


def _array_ref(arr: np.ndarray, frames: list[Frame]) -> tuple[str, tuple[int, ...], int]:
    dtype = _wire_dtype(arr.dtype)
    if arr.ndim > MAX_NDIM:
        raise WireError(f"an array of {arr.ndim} dimensions cannot travel (at most {MAX_NDIM})")
    # a copy only where the bytes are not already C-ordered little-endian
    arr = np.ascontiguousarray(arr, dtype=dtype)
    frames.append(arr.reshape(-1).view(np.uint8).data)
    return dtype.str, arr.shape, len(frames) - 1


def _wire_dtype(dtype: np.dtype) -> np.dtype:
    if dtype.str in ALLOWED_DTYPES:
        return dtype
    if dtype.byteorder == ">" and dtype.newbyteorder("<").str in ALLOWED_DTYPES:
        return dtype.newbyteorder("<")
    raise WireError(
        f"arrays of dtype {dtype} cannot travel on the wire; use one of {list(ALLOWED_DTYPES)}"
    )


def _array_from_ref(obj: Any, views: list[memoryview], next_frame: list[int]) -> np.ndarray:
    if type(obj) is not list or len(obj) != 3:
        raise WireError("an array must be [dtype, shape, frame_idx]")
    dtype_str, shape, frame_idx = obj
    dtype = ALLOWED_DTYPES.get(dtype_str) if type(dtype_str) is str else None
    if dtype is None:
        raise WireError(f"array dtype {dtype_str!r} is not one of {list(ALLOWED_DTYPES)}")
    if (
        type(shape) is not list
        or len(shape) > MAX_NDIM
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise WireError(f"array shape {shape!r} is not a list of at most {MAX_NDIM} dims >= 0")
    expected = next_frame[0]
    if type(frame_idx) is not int or frame_idx != expected or frame_idx >= len(views):
        raise WireError(
            f"array references frame {frame_idx!r}; expected frame {expected} of {len(views)}"
        )
    view = views[frame_idx]
    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes != view.nbytes:
        raise WireError(
            f"array {dtype_str} {shape} needs {num_bytes} bytes, frame {frame_idx} has "
            f"{view.nbytes}"
        )
    next_frame[0] = expected + 1
    return np.frombuffer(view, dtype=dtype).reshape(shape)


def _byte_view(frame: Any, idx: int) -> memoryview:
    try:
        view = memoryview(frame)
    except TypeError as exc:
        raise WireError(f"frame {idx} is a {type(frame).__name__}, not a buffer") from exc
    if not view.c_contiguous:
        raise WireError(f"frame {idx} is not a contiguous buffer")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def _names() -> list[str]:
    return [t.__name__ for t in MESSAGE_TAGS]
