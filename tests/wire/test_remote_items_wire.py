"""RemoteItems across the API -> engine-core seam: headers in msgpack, payloads as raw frames."""

from __future__ import annotations

import pickle

import blake3
import msgspec
import numpy as np
import pytest

from mmserve.multimodal import (
    MultiModalFeature,
    PlaceholderRange,
    ProcessedImage,
    ProcessedPrompt,
    RemoteItem,
)
from mmserve.sampling_params import SamplingParams
from mmserve.wire import WireError, WireRemoteItem, convert, decode, encode
from tests.wire.samples import positions

FILE_BYTES = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 3  # what travels is opaque here
RGB = bytes(range(6 * 4 * 3))  # a 6x4 uint8 [H, W, 3] array, packed


def _digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def _remote(source: str, grid: tuple[int, int, int] = (1, 4, 6)) -> RemoteItem:
    payload = {"bytes": FILE_BYTES, "rgb": RGB, "url": None}[source]
    return RemoteItem(
        source=source,
        payload=payload,
        url="https://images.example/cat.png" if source == "url" else None,
        rgb_size=(6, 4) if source == "rgb" else None,
        min_pixels=3136,
        max_pixels=1003520,
        grid_thw=grid,
        content_digest=_digest(payload or b"the url's bytes"),
    )


def _feature(identifier: str, offset: int, data, modality: str = "image") -> MultiModalFeature:
    grid = (1, 4, 6)
    return MultiModalFeature(identifier, modality, PlaceholderRange(offset, 6), data, grid)


def _prompt() -> ProcessedPrompt:
    pixels = ProcessedImage(np.ones((24, 6), dtype=np.float32), (1, 4, 6))
    features = [
        _feature("b" * 64, 2, _remote("bytes")),
        _feature("r" * 64, 10, _remote("rgb")),
        _feature("u" * 64, 18, _remote("url")),
        _feature("p" * 64, 26, pixels),
        _feature("b" * 64, 34, _remote("bytes")),  # the same item again: sent once
    ]
    return ProcessedPrompt(list(range(44)), features, positions(44), 0)


def _through_wire(msg):
    return decode([bytes(f) for f in encode(msg)])


def test_remote_items_round_trip_with_each_payload_a_raw_frame() -> None:
    msg = convert.request_to_wire("r1", _prompt(), SamplingParams(), arrival_time_s=1.0)
    assert [w.identifier for w in msg.remote_items] == ["b" * 64, "r" * 64, "u" * 64]
    assert [i.identifier for i in msg.encoder_inputs] == ["p" * 64]
    frames = encode(msg)
    # header, the pixel frame, the file and rgb payloads (the URL has none), the positions
    assert len(frames) == 5
    raw = [bytes(f) for f in frames]
    assert FILE_BYTES in raw and RGB in raw
    assert FILE_BYTES not in raw[0] and RGB not in raw[0]  # never inside msgpack
    add = convert.request_from_wire(decode(raw))
    for got, want in zip(add.prompt.mm_features, _prompt().mm_features, strict=True):
        assert (got.identifier, got.placeholder, got.grid_thw) == (
            want.identifier,
            want.placeholder,
            want.grid_thw,
        )
        if isinstance(want.data, RemoteItem):
            assert got.data == want.data
        else:
            np.testing.assert_array_equal(got.data.pixel_values, want.data.pixel_values)


def test_remote_items_the_engine_holds_are_left_out() -> None:
    msg = convert.request_to_wire(
        "r1", _prompt(), SamplingParams(), arrival_time_s=0.0, held_identifiers={"b" * 64}
    )
    assert [w.identifier for w in msg.remote_items] == ["r" * 64, "u" * 64]
    add = convert.request_from_wire(_through_wire(msg))
    assert [f.data is None for f in add.prompt.mm_features] == [True, False, False, False, True]


def test_round_trips_never_call_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("pickle was called on a wire path")

    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    msg = convert.request_to_wire("r1", _prompt(), SamplingParams(), arrival_time_s=0.0)
    add = convert.request_from_wire(_through_wire(msg))
    assert add.prompt.mm_features[1].data == _remote("rgb")


def _wire_item(**changes) -> WireRemoteItem:
    item = convert.remote_item_to_wire("b" * 64, _remote("bytes"))
    fields = {f: getattr(item, f) for f in item.__struct_fields__}
    return WireRemoteItem(**{**fields, **changes})


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"url": "https://x.example/a.png"}, "payload or a URL"),
        ({"payload": None}, "payload or a URL"),
        ({"payload": np.zeros(4, dtype=np.float32)}, "not uint8"),
        ({"source": "rgb", "rgb_size": (6, 5)}, "holds 90 bytes"),
        ({"rgb_size": (6, 4)}, "rgb_size comes exactly"),
        ({"min_pixels": 2_000_000}, "min_pixels"),
    ],
)
def test_a_remote_item_that_breaks_its_rules_is_refused(changes: dict, match: str) -> None:
    with pytest.raises(WireError, match=match):
        _wire_item(**changes)


def test_forged_remote_items_are_refused_on_arrival() -> None:
    prompt = ProcessedPrompt(
        list(range(12)), [_feature("b" * 64, 2, _remote("bytes"))], positions(12)
    )
    msg = convert.request_to_wire("r1", prompt, SamplingParams(), arrival_time_s=0.0)
    fields = {f: getattr(msg, f) for f in msg.__struct_fields__}
    forged_digest = _wire_item(content_digest="not hex")  # checked on decode, as every bound
    with pytest.raises(WireError, match="matching regex"):
        _through_wire(type(msg)(**{**fields, "remote_items": [forged_digest]}))
    with pytest.raises(WireError, match="matches none of the request's items"):
        type(msg)(**{**fields, "remote_items": [_wire_item(grid_thw=(1, 4, 8))]})
    video = msgspec.structs.replace(msg.mm_features[0], modality="video")
    with pytest.raises(WireError, match="not an image item"):
        type(msg)(**{**fields, "mm_features": [video]})
