"""The messages between a language-model server and its `mmserve encode` pool, and their codec.

Every message is three ZMQ frames:

    [header, payload, mac]
    header   msgpack of one tagged Struct below (at most MAX_HEADER_BYTES); an EncodeItem's
             RemoteItem stands in it with its payload's byte count in place of the payload
    payload  raw bytes: the image file or RGB array sent, or the embeddings returned; may be empty
    mac      HMAC-SHA256(secret, len-prefixed header || len-prefixed payload), or empty without
             a shared secret

Nothing is ever unpickled: a header is plain data validated by msgspec against these types, and
the payload is bytes whose meaning the header states (dtype, shape). Whatever fails to decode
or to verify raises `MalformedMessage`, which the receiver counts and drops.

No torch here: tensors cross as bytes, and the two ends turn them into tensors.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import blake3
import msgspec
import numpy as np

from mmserve.hashing import content_digest as content_digest  # re-exported for both ends
from mmserve.multimodal import RemoteItem

MAX_HEADER_BYTES = 64 * 1024
MAC_BYTES = 32  # SHA-256
# The pairing handshake's version (`GET /v1/encode/info`); an LM server pairs only with an
# encoder of the same one. 2: the info names `embedding_width` (the row width, hidden size x
# (1 + DeepStack levels)) where 1 named `hidden_size`.
ENCODER_PROTOCOL_VERSION = 2

Source = Literal["bytes", "rgb", "url"]
# The embedding dtypes on the wire, and their element sizes (embedding_dtypes.py maps the
# same names to torch dtypes on both ends).
EmbeddingDType = Literal["float32", "bfloat16", "float16"]
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

# Why an encoder could not encode an item. The first group is the input's fault (the LM fails
# the request with a 400 and does not retry); the second is the encoder's (retry elsewhere).
INPUT_ERROR_CODES = (
    "invalid_image",  # not a decodable image, or over the pixel limits
    "fetch_refused",  # the URL policy refused it (scheme, host, address, redirect)
    "fetch_failed",  # the URL could not be fetched (status, timeout, too large)
    "grid_mismatch",  # the encoder's plan differs from the LM's
    "content_changed",  # the bytes' digest differs from the plan's (the URL changed)
    "bad_request",  # the message itself is inconsistent (sizes, fields)
)
ENCODER_ERROR_CODES = (
    "internal",  # the vision tower or the CPU stage failed
    "overloaded",  # the encoder's queue is full
    "shutting_down",
)
ERROR_CODES = INPUT_ERROR_CODES + ENCODER_ERROR_CODES


class MalformedMessage(Exception):
    """A received message that is not one of ours: dropped and counted under `reason`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EncodeItem(msgspec.Struct, frozen=True, tag="encode", forbid_unknown_fields=True):
    """Encode one image item: `item` says where its bytes are and what the LM planned; its
    payload ("bytes", "rgb") travels as the message's payload frame."""

    request_id: str
    item_index: int
    identifier: str  # the LM's identity of the item: echoed back, a key for the LM only
    attempt: int  # the LM drops replies to older attempts
    item: RemoteItem
    modality: Literal["image"] = "image"


class EncodeResult(msgspec.Struct, frozen=True, tag="result", forbid_unknown_fields=True):
    """The answer to one EncodeItem: the payload holds the item's encoder output,
    [num_embeds, embedding_width] (each row the main embedding then every DeepStack level)."""

    request_id: str
    item_index: int
    identifier: str
    attempt: int
    grid_thw: tuple[int, int, int]
    dtype: EmbeddingDType
    shape: tuple[int, int]
    error_code: str | None = None  # None: success; else one of ERROR_CODES
    error_message: str | None = None
    cache_hit: bool = False  # the encoder had the embeddings resident


class Cancel(msgspec.Struct, frozen=True, tag="cancel", forbid_unknown_fields=True):
    """Drop queued work for these (identifier, attempt) pairs; nobody waits for them."""

    identifiers: list[str]
    attempts: list[int]


class Ping(msgspec.Struct, frozen=True, tag="ping", forbid_unknown_fields=True):
    nonce: int


class Pong(msgspec.Struct, frozen=True, tag="pong", forbid_unknown_fields=True):
    nonce: int
    queued_patches: int  # input patches waiting in the encoder's queue (its load)
    model_fingerprint: str


Message = EncodeItem | EncodeResult | Cancel | Ping | Pong

# The order of RemoteItem's fields: its header is a positional array.
_REMOTE_FIELDS = tuple(f.name for f in msgspec.structs.fields(RemoteItem))


def _enc_hook(obj: object) -> object:
    if isinstance(obj, np.ndarray):  # a RemoteItem's payload: its bytes go in the payload frame
        return int(obj.nbytes)
    raise TypeError(f"{type(obj).__name__} values cannot travel in a header")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode_message(
    msg: Message, payload: bytes | memoryview = b"", secret: bytes | None = None
) -> list[bytes | memoryview]:
    """The three frames of `msg` (the payload is not copied). An EncodeItem's payload is its
    RemoteItem's; pass none for it."""
    if isinstance(msg, EncodeItem):
        if len(memoryview(payload)):
            raise ValueError("an EncodeItem carries its payload in its RemoteItem")
        payload = msg.item.payload_bytes
    header = _encoder.encode(msg)
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"message header of {len(header)} bytes is over {MAX_HEADER_BYTES}")
    mac = b"" if secret is None else _mac(secret, header, payload)
    return [header, payload, mac]


def decode_message(
    frames: Sequence[bytes | memoryview], secret: bytes | None = None
) -> tuple[Message, memoryview]:
    """The message and its payload (a view of the received frame); raises MalformedMessage."""
    if len(frames) != 3:
        raise MalformedMessage("frame_count")
    header, payload, mac = (memoryview(f).cast("B") for f in frames)
    if len(header) > MAX_HEADER_BYTES:
        raise MalformedMessage("header_too_large")
    if secret is None:
        if len(mac):
            raise MalformedMessage("unexpected_mac")
    elif len(mac) != MAC_BYTES or not hmac.compare_digest(_mac(secret, header, payload), mac):
        raise MalformedMessage("bad_mac")
    try:
        msg = _decoder_for(payload).decode(header)
    except msgspec.ValidationError as exc:
        raise MalformedMessage(_item_reason(header, len(payload))) from exc
    except msgspec.DecodeError as exc:
        raise MalformedMessage("bad_header") from exc
    _check_fields(msg, len(payload))
    return msg, payload


def _decoder_for(payload: memoryview) -> msgspec.msgpack.Decoder:
    """A header decoder that gives a RemoteItem the payload frame (a view, no copy)."""

    def dec_hook(type_: type, obj: object) -> object:
        if type_ is np.ndarray and type(obj) is int and obj == len(payload):
            return np.frombuffer(payload, dtype=np.uint8)
        # msgspec turns this into a ValidationError (a payload of another size, a non-count)
        raise ValueError(f"a payload of {obj!r} bytes, not the {len(payload)} that came")

    return msgspec.msgpack.Decoder(Message, dec_hook=dec_hook)


def _item_reason(header: memoryview, payload_len: int) -> str:
    """Why a header failed validation, named by the pool's reasons: RemoteItem's own checks
    say only "invalid", so an item's raw fields are checked again here to name the cause."""
    try:
        raw = msgspec.msgpack.decode(header)
        item = dict(zip(_REMOTE_FIELDS, raw["item"], strict=True))
        payload_count, grid, rgb_size = item["payload"], item["grid_thw"], item["rgb_size"]
        if raw["item_index"] < 0 or raw["attempt"] < 0 or min(grid) <= 0:
            return "bad_fields"
        if item["min_pixels"] <= 0 or item["max_pixels"] < item["min_pixels"]:
            return "bad_fields"
        is_url = item["source"] == "url"
        if is_url != (item["url"] is not None) or is_url != (payload_count is None):
            return "bad_source"
        if payload_count is not None and payload_count != payload_len:
            return "bad_source"
        if (item["source"] == "rgb") != (rgb_size is not None):
            return "bad_source"
        if rgb_size is not None:
            w, h = rgb_size
            if w <= 0 or h <= 0 or w * h * 3 != payload_len:
                return "bad_rgb_size"
    except (TypeError, ValueError, KeyError, msgspec.DecodeError):
        pass  # not even the shape of an item: a bad header
    return "bad_header"


def _mac(secret: bytes, header: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (header, payload):
        h.update(struct.pack("<Q", len(memoryview(part).cast("B"))))
        h.update(part)
    return h.digest()


def _check_fields(msg: Message, payload_len: int) -> None:
    """What msgspec's types cannot say: sizes that must agree with each other."""
    if isinstance(msg, EncodeItem):  # RemoteItem checked the rest on decode
        if msg.item_index < 0 or msg.attempt < 0:
            raise MalformedMessage("bad_fields")
        if (msg.item.source == "url") != (payload_len == 0):  # an empty file, or bytes + URL
            raise MalformedMessage("bad_source")
    elif isinstance(msg, EncodeResult):
        if msg.error_code is None:
            if min(msg.shape) <= 0:
                raise MalformedMessage("bad_shape")
        elif msg.error_code not in ERROR_CODES:
            raise MalformedMessage("bad_error_code")
        elif payload_len:
            raise MalformedMessage("error_with_payload")
    elif isinstance(msg, Cancel) and len(msg.identifiers) != len(msg.attempts):
        raise MalformedMessage("bad_fields")


def check_result_payload(
    result: EncodeResult,
    payload_len: int,
    *,
    expected_grid: tuple[int, int, int],
    expected_num_embeds: int,
    expected_width: int,
) -> str | None:
    """Why a successful result does not fit the item it answers, in words; None if it fits.
    `expected_width` is the model's row width (hidden size x (1 + DeepStack levels))."""
    if tuple(result.grid_thw) != tuple(expected_grid):
        return f"grid {tuple(result.grid_thw)} differs from the planned {tuple(expected_grid)}"
    num_embeds, width = result.shape
    if num_embeds != expected_num_embeds:
        return f"{num_embeds} embeddings for an item of {expected_num_embeds} placeholder tokens"
    if width != expected_width:
        return (
            f"embedding rows of width {width}, the model's are {expected_width} wide "
            "(hidden size x (1 + DeepStack levels))"
        )
    expected_bytes = num_embeds * width * DTYPE_BYTES[result.dtype]
    if payload_len != expected_bytes:
        return (
            f"{payload_len} payload bytes for {num_embeds} x {width} {result.dtype} "
            f"({expected_bytes} bytes)"
        )
    return None


def is_input_error(code: str) -> bool:
    """Whether an error code is the input's fault (no retry: the request fails with a 400)."""
    return code in INPUT_ERROR_CODES


def read_secret_file(path: str | Path, flag: str = "--encoder-secret-file") -> bytes:
    """The secret a language-model server and its encoders share, from `path` (surrounding
    whitespace dropped). Both ends read it with this one rule: printable ASCII without spaces,
    since it also travels in an Authorization header. ValueError names `flag` and the path."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    if not secret:
        raise ValueError(f"{flag} {path} is empty; write the shared secret in it")
    if not secret.isascii() or any(c <= 32 or c == 127 for c in secret):
        raise ValueError(
            f"{flag} {path}: the secret must be printable ASCII without spaces "
            "(it travels in an Authorization header)"
        )
    return secret


def model_fingerprint(model_dir: str | Path) -> str:
    """What makes two servers' embeddings interchangeable: the model and processor configs and
    the names and sizes of the weight files. An LM server refuses an encoder whose
    fingerprint differs (its embeddings would be another model's)."""
    model_dir = Path(model_dir)
    h = blake3.blake3()
    for name in ("config.json", "preprocessor_config.json"):
        path = model_dir / name
        if path.is_file():
            # canonical JSON: key order and whitespace do not change the fingerprint
            canonical = json.dumps(json.loads(path.read_text()), sort_keys=True)
            h.update(f"{name}\0{canonical}\0".encode())
    for path in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
    return h.hexdigest()
