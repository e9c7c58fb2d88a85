"""RemoteItems across the API -> engine-core seam: headers in msgpack, payloads as raw frames."""

from __future__ import annotations

import dataclasses
import pickle

import blake3
import msgspec
import numpy as np
import pytest

from mmserve.multimodal import (
    EncoderInput,
    MultiModalFeature,
    PlaceholderRange,
    ProcessedPrompt,
    RemoteItem,
)
from mmserve.sampling_params import SamplingParams
from mmserve.wire import EngineCoreRequest, WireError, decode, encode
from tests.support.factory import CLIP_NORMALIZATION
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


def _feature(identifier: str, offset: int, *, is_remote: bool = True) -> MultiModalFeature:
    grid = (1, 4, 6)
    placeholder = PlaceholderRange(offset, 6)
    return MultiModalFeature(identifier, "image", placeholder, grid, is_remote=is_remote)


def _prompt() -> ProcessedPrompt:
    pixels = EncoderInput(np.ones((24, 6), dtype=np.uint8), (1, 4, 6), CLIP_NORMALIZATION)
    features = [
        _feature("b" * 64, 2),
        _feature("r" * 64, 10),
        _feature("u" * 64, 18),
        _feature("p" * 64, 26, is_remote=False),
        _feature("b" * 64, 34),  # the same item again: sent once
    ]
    data = {
        "b" * 64: _remote("bytes"),
        "r" * 64: _remote("rgb"),
        "u" * 64: _remote("url"),
        "p" * 64: pixels,
    }
    return ProcessedPrompt(list(range(44)), features, positions(44), 0, mm_data=data)


def _through_wire(msg):
    return decode([bytes(f) for f in encode(msg)])


def _request(prompt: ProcessedPrompt) -> EngineCoreRequest:
    return EngineCoreRequest.of("r1", prompt, SamplingParams(), arrival_time_s=1.0)


def test_remote_items_round_trip_with_each_payload_a_raw_frame() -> None:
    msg = _request(_prompt())
    assert list(msg.remote_items) == ["b" * 64, "r" * 64, "u" * 64]
    assert list(msg.encoder_inputs) == ["p" * 64]
    frames = encode(msg)
    # header, the pixel frame, the file and rgb payloads (the URL has none), the positions
    assert len(frames) == 5
    raw = [bytes(f) for f in frames]
    assert FILE_BYTES in raw and RGB in raw
    assert FILE_BYTES not in raw[0] and RGB not in raw[0]  # never inside msgpack
    got = decode(raw).prompt()
    want = _prompt()
    assert got.mm_features == want.mm_features
    for identifier, item in want.mm_data.items():
        if isinstance(item, RemoteItem):
            _assert_same_remote(got.mm_data[identifier], item)
        else:
            np.testing.assert_array_equal(got.mm_data[identifier].pixel_values, item.pixel_values)


def _assert_same_remote(got: RemoteItem, want: RemoteItem) -> None:
    fields = [f for f in want.__struct_fields__ if f != "payload"]
    assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields]
    assert bytes(got.payload_bytes) == bytes(want.payload_bytes)


def test_items_without_data_travel_as_specs_only() -> None:
    """An item named by UUID and cached has no data in the prompt: only its spec travels."""
    prompt = _prompt()
    held = {k: v for k, v in prompt.mm_data.items() if k != "b" * 64}
    msg = _through_wire(_request(dataclasses.replace(prompt, mm_data=held)))
    assert list(msg.remote_items) == ["r" * 64, "u" * 64]
    assert [f.identifier for f in msg.mm_features] == [f.identifier for f in prompt.mm_features]
    assert "b" * 64 not in msg.prompt().mm_data


def test_round_trips_never_call_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("pickle was called on a wire path")

    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    got = _through_wire(_request(_prompt())).prompt()
    _assert_same_remote(got.mm_data["r" * 64], _remote("rgb"))


def _item(**changes) -> RemoteItem:
    item = _remote("bytes")
    fields = {f: getattr(item, f) for f in item.__struct_fields__}
    return RemoteItem(**{**fields, **changes})


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
    with pytest.raises(ValueError, match=match):
        _item(**changes)


def test_forged_remote_items_are_refused_on_arrival() -> None:
    prompt = ProcessedPrompt(
        list(range(12)),
        [_feature("b" * 64, 2)],
        positions(12),
        mm_data={"b" * 64: _remote("bytes")},
    )
    msg = _request(prompt)
    fields = {f: getattr(msg, f) for f in msg.__struct_fields__}
    forged_digest = _item(content_digest="not hex")  # checked on decode, as every bound
    with pytest.raises(WireError, match="matching regex"):
        _through_wire(type(msg)(**{**fields, "remote_items": {"b" * 64: forged_digest}}))
    forged_rule = _item()
    msgspec.structs.force_setattr(forged_rule, "source", "url")  # past its own check
    with pytest.raises(WireError, match="payload or a URL"):
        _through_wire(type(msg)(**{**fields, "remote_items": {"b" * 64: forged_rule}}))
    with pytest.raises(WireError, match="matches none of the request's items"):
        type(msg)(**{**fields, "remote_items": {"b" * 64: _item(grid_thw=(1, 4, 8))}})
    video = msgspec.structs.replace(msg.mm_features[0], modality="video")
    with pytest.raises(WireError, match="not an image item"):
        type(msg)(**{**fields, "mm_features": [video]})
