"""What the envelopes share: the error, the base struct, field types and their checks."""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np

from mmserve.multimodal import MultiModalFeature


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


def check_positions(positions: np.ndarray, num_tokens: int, owner: str) -> None:
    """M-RoPE positions must be int64 [3, num_tokens]: the runner slices them by token index."""
    if positions.dtype != np.int64 or positions.shape != (3, num_tokens):
        raise WireError(
            f"{owner}: mrope_positions is {positions.dtype} {positions.shape}, "
            f"expected int64 (3, {num_tokens})"
        )


def check_features(features: list[MultiModalFeature], num_tokens: int, owner: str) -> None:
    """Every item's placeholder range must lie inside the prompt it belongs to."""
    for f in features:
        if f.placeholder.end > num_tokens:
            raise WireError(
                f"{owner}: item {f.identifier[:16]} covers positions "
                f"[{f.placeholder.offset}, {f.placeholder.end}) "
                f"but the prompt has {num_tokens} tokens"
            )
