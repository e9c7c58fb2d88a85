"""Remote items and their results cross the scheduler -> executor seam; payloads as raw frames."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest

from mmserve.errors import FailureKind, RequestFailure
from mmserve.multimodal import RemoteItem
from mmserve.scheduling import ModelRunnerOutput, SchedulerOutput
from mmserve.wire import (
    WireError,
    WireMMFeature,
    WireRemoteEncoderInput,
    WireRemoteItem,
    WireSchedulerOutput,
    convert,
    decode,
    encode,
)
from tests.support.fake_runner import image

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40  # 10 KiB that must not enter the body


def _remote(identifier: str, offset: int, item: RemoteItem):
    return dataclasses.replace(image(identifier, offset, 4), data=item)


def _items() -> list[RemoteItem]:
    grid = (1, 2, 8)
    return [
        RemoteItem("bytes", PNG, None, None, 3136, 12845056, grid, "a" * 64),
        RemoteItem("rgb", bytes(range(24)), None, (4, 2), 3136, 12845056, grid, "b" * 64),
        RemoteItem("url", None, "https://example.com/cat.png", None, 3136, 1 << 20, grid, "c" * 64),
    ]


def _step(features) -> SchedulerOutput:
    return SchedulerOutput(
        [], [], {}, 0, {}, ["gone"], frozenset(), frozenset(), remote_encoder_inputs=features
    )


def test_remote_items_round_trip_with_their_payloads_in_raw_frames() -> None:
    bytes_item, rgb_item, url_item = _items()
    features = {
        "r1": [_remote("i1", 2, bytes_item), _remote("i2", 9, rgb_item)],
        "r2": [_remote("i3", 0, url_item)],
    }
    frames = encode(convert.scheduler_output_to_wire(_step(features), lambda rid: []))
    assert len(frames) == 3  # the body, then one frame per payload (the URL item has none)
    assert PNG not in bytes(frames[0]) and bytes(frames[1]) == PNG
    msg = decode([bytes(f) for f in frames])
    assert isinstance(msg, WireSchedulerOutput)
    step = convert.scheduler_output_from_wire(msg, lambda p: p)
    assert step.scheduler_output.remote_encoder_inputs == features
    assert step.scheduler_output.free_encoder_identifiers == ["gone"]


def test_arrivals_and_failures_cross_back() -> None:
    failure = RequestFailure(
        "no encoder could encode image item 0 of request r", FailureKind.UNAVAILABLE
    )
    out = ModelRunnerOutput(
        {"r": [5]}, encoder_arrived=["i1", "i2"], encoder_failed={"i3": failure}
    )
    msg = decode([bytes(f) for f in encode(convert.runner_output_to_wire(out))])
    assert convert.runner_output_from_wire(msg) == out


def test_a_remote_item_that_breaks_its_rules_is_a_wire_error() -> None:
    grid = (1, 2, 8)
    digest = "d" * 64
    with pytest.raises(WireError, match="not uint8"):
        WireRemoteItem("i1", "bytes", np.zeros(4, np.float32), None, None, 1, 2, grid, digest)
    with pytest.raises(WireError, match="payload or a URL"):
        WireRemoteItem("i1", "url", np.zeros(4, np.uint8), "https://x", None, 1, 2, grid, digest)
    feature = WireMMFeature("i1", "image", 0, 4, (1, 2, 6))
    with pytest.raises(WireError, match="grid"):
        WireRemoteEncoderInput("r", feature, convert.remote_item_to_wire("i1", _items()[0]))
    other = WireMMFeature("i2", "image", 0, 4, grid)
    with pytest.raises(WireError, match="sent for feature"):
        WireRemoteEncoderInput("r", other, convert.remote_item_to_wire("i1", _items()[0]))


def test_a_forged_payload_frame_of_the_wrong_size_is_refused() -> None:
    features = {"r1": [_remote("i1", 2, _items()[0])]}
    frames = [
        bytes(f) for f in encode(convert.scheduler_output_to_wire(_step(features), lambda r: []))
    ]
    with pytest.raises(WireError, match="needs"):
        decode([frames[0], frames[1][:-1]])
    body = msgspec.msgpack.decode(frames[0][3:])
    assert body[-1][0][2][2][1] == [len(PNG)]  # the payload is an array reference: shape
