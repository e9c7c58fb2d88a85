"""The pool's messages: round trips, the MAC, and every malformed frame refused by name."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from mmserve.disaggregation.protocol import (
    Cancel,
    EncodeItem,
    EncodeResult,
    MalformedMessage,
    Ping,
    Pong,
    check_result_payload,
    content_digest,
    decode_message,
    encode_message,
    model_fingerprint,
)
from mmserve.multimodal import RemoteItem

SECRET = b"s3cret"


def _item(**kw) -> EncodeItem:
    fields = dict(
        source="rgb",
        payload=bytes(12),
        url=None,
        rgb_size=(2, 2),
        min_pixels=3136,
        max_pixels=12845056,
        grid_thw=(1, 4, 4),
        content_digest=content_digest(bytes(2 * 2 * 3)),
    )
    fields.update(kw)
    return EncodeItem("r1", 0, "ab" * 32, 1, RemoteItem(**fields))


def _same(got, msg) -> bool:
    if not isinstance(msg, EncodeItem):
        return got == msg

    def fields(m: EncodeItem) -> dict:
        item = msgspec.structs.asdict(m.item) | {"payload": m.item.payload_bytes.tobytes()}
        return msgspec.structs.asdict(m) | {"item": item}

    return fields(got) == fields(msg)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_round_trip_every_kind(secret):
    result = EncodeResult("r1", 0, "ab" * 32, 1, (1, 4, 4), "bfloat16", (4, 8))
    for msg, payload in [
        (_item(), b""),  # an item's payload is its RemoteItem's
        (result, bytes(4 * 8 * 2)),
        (Cancel(["x"], [2]), b""),
        (Ping(7), b""),
        (Pong(7, 100, "f" * 64), b""),
    ]:
        frames = encode_message(msg, payload, secret)
        got, got_payload = decode_message([bytes(f) for f in frames], secret)
        sent = msg.item.payload_bytes.tobytes() if isinstance(msg, EncodeItem) else payload
        assert _same(got, msg) and bytes(got_payload) == sent


def test_mac_is_checked_both_ways():
    frames = [bytes(f) for f in encode_message(Ping(1), b"", SECRET)]
    with pytest.raises(MalformedMessage, match="bad_mac"):
        decode_message(frames, b"other")
    with pytest.raises(MalformedMessage, match="unexpected_mac"):
        decode_message(frames, None)
    unsigned = [bytes(f) for f in encode_message(Ping(1))]
    with pytest.raises(MalformedMessage, match="bad_mac"):
        decode_message(unsigned, SECRET)
    tampered = [bytes(f) for f in encode_message(_item(), secret=SECRET)]
    tampered[1] = b"\x01" + tampered[1][1:]
    with pytest.raises(MalformedMessage, match="bad_mac"):
        decode_message(tampered, SECRET)


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"x"], "frame_count"),
        ([b"\xc1garbage", b"", b""], "bad_header"),
        ([b"\x80", b"", b""], "bad_header"),  # an empty map: no tag
        ([bytes(70_000), b"", b""], "header_too_large"),
    ],
)
def test_garbage_is_refused_by_name(frames, reason):
    with pytest.raises(MalformedMessage, match=reason):
        decode_message(frames)


def test_pickle_is_never_executed():
    import pickle

    frames = [pickle.dumps(Ping(1)), b"", b""]
    with pytest.raises(MalformedMessage, match="bad_header"):
        decode_message(frames)


@pytest.mark.parametrize(
    ("kw", "payload", "reason"),
    [
        ({"rgb_size": (3, 2)}, bytes(12), "bad_rgb_size"),
        ({"source": "url", "url": "http://x/a.png", "rgb_size": None}, bytes(12), "bad_source"),
        ({"source": "bytes", "rgb_size": None}, b"", "bad_source"),
        ({"grid_thw": (1, 0, 4)}, bytes(12), "bad_fields"),
        ({"max_pixels": 10}, bytes(12), "bad_fields"),
    ],
)
def test_inconsistent_items_are_refused(kw, payload, reason):
    item = _item()  # forged past RemoteItem's checks, as a peer could send it
    for name, value in kw.items():
        msgspec.structs.force_setattr(item.item, name, value)
    frames = [bytes(f) for f in encode_message(item)]
    frames[1] = payload
    with pytest.raises(MalformedMessage, match=reason):
        decode_message(frames)


def test_result_payload_checks_name_the_mismatch():
    ok = EncodeResult("r", 0, "i", 1, (1, 4, 4), "float32", (4, 8))
    fit = dict(expected_grid=(1, 4, 4), expected_num_embeds=4, expected_width=8)
    assert check_result_payload(ok, 4 * 8 * 4, **fit) is None
    assert "payload bytes" in check_result_payload(ok, 10, **fit)
    assert "rows of width 8, the model's are 16 wide" in check_result_payload(
        ok, 128, **{**fit, "expected_width": 16}
    )
    assert "placeholder tokens" in check_result_payload(
        ok, 128, **{**fit, "expected_num_embeds": 5}
    )
    assert "grid" in check_result_payload(ok, 128, **{**fit, "expected_grid": (1, 2, 8)})
    failed = [
        bytes(f) for f in encode_message(ok.__class__(**{**_fields(ok), "error_code": "nope"}))
    ]
    with pytest.raises(MalformedMessage, match="bad_error_code"):
        decode_message(failed)


def _fields(s) -> dict:
    return {f: getattr(s, f) for f in s.__struct_fields__}


def test_fingerprint_follows_config_not_formatting(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1, "b": 2}')
    (tmp_path / "model.safetensors").write_bytes(bytes(10))
    first = model_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text('{"b": 2,\n "a": 1}')
    assert model_fingerprint(tmp_path) == first
    (tmp_path / "config.json").write_text('{"a": 1, "b": 3}')
    assert model_fingerprint(tmp_path) != first


def test_fingerprint_tells_deepstack_levels_apart(tmp_path):
    """Two checkpoints that differ only in their DeepStack levels return rows of different
    widths: an LM server never pairs with the other's encoder."""
    vision = {"depth": 4, "out_hidden_size": 64, "deepstack_visual_indexes": [0, 1, 2]}
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": vision}))
    deep = model_fingerprint(tmp_path)
    vision["deepstack_visual_indexes"] = [0, 1]
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": vision}))
    assert model_fingerprint(tmp_path) != deep


def test_protocol_imports_no_torch():
    code = (
        "import sys, mmserve.disaggregation.protocol; sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
