"""Every message type survives encode -> decode field for field, arrays without copies."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from mmserve.multimodal import EncoderInput
from mmserve.sampling_params import SamplingParams
from mmserve.wire import (
    MESSAGE_TAGS,
    EngineCoreRequest,
    WireError,
    decode,
    encode,
)
from mmserve.wire.codec import HEADER_BYTES, MAGIC, VERSION
from tests.support.factory import CLIP_NORMALIZATION, CLIP_VIDEO_NORMALIZATION
from tests.wire.samples import (
    all_messages,
    assert_same,
    engine_core_request,
    feature,
    pixels,
)

MESSAGES = all_messages()


@pytest.mark.parametrize(("name", "msg"), MESSAGES, ids=[name for name, _ in MESSAGES])
def test_round_trip_keeps_every_field(name, msg):
    frames = encode(msg)
    assert_same(decode(frames), msg)
    # what a socket delivers: each frame as its own bytes object
    assert_same(decode([bytes(f) for f in frames]), msg)


@pytest.mark.parametrize(("name", "msg"), MESSAGES, ids=[name for name, _ in MESSAGES])
def test_header_names_magic_version_and_type(name, msg):
    head = bytes(encode(msg)[0][:HEADER_BYTES])
    assert head == bytes((MAGIC, VERSION, MESSAGE_TAGS[type(msg)]))


def test_tags_are_distinct_bytes():
    tags = list(MESSAGE_TAGS.values())
    assert len(set(tags)) == len(tags) and all(0 < t < 256 for t in tags)


def test_every_array_is_its_own_frame_and_nothing_is_copied():
    msg = engine_core_request(2)
    frames = encode(msg)
    arrays = [item.pixel_values for item in msg.encoder_inputs.values()]
    arrays.append(msg.mrope_positions)
    # frame 0 is small: the pixels are not in the msgpack body
    assert len(frames) == 1 + len(arrays)
    assert len(frames[0]) < 2_000
    for frame, arr in zip(frames[1:], arrays, strict=True):
        assert memoryview(frame).nbytes == arr.nbytes
        assert np.shares_memory(np.frombuffer(frame, np.uint8), arr), "encode copied an array"
    decoded = decode(frames)
    first = next(iter(decoded.encoder_inputs.values()))
    assert np.shares_memory(first.pixel_values, arrays[0])
    assert np.shares_memory(decoded.mrope_positions, msg.mrope_positions)


def test_decoded_arrays_are_read_only_views_of_the_frames():
    frames = [bytes(f) for f in encode(engine_core_request(1))]
    decoded = decode(frames)
    with pytest.raises(ValueError, match="read-only"):
        decoded.mrope_positions[0, 0] = 1


def test_a_strided_array_travels_as_a_contiguous_copy():
    f = feature(0, offset=0)
    base = pixels(f.grid_thw, 0)
    wide = np.repeat(base, 2, axis=1)[:, ::2]  # same values, not C-contiguous
    item = EncoderInput(wide, f.grid_thw, CLIP_NORMALIZATION)
    msg = EngineCoreRequest(
        "r", [0] * f.num_embeds, [f], {f.identifier: item}, SamplingParams(), None, 0, None,
        None, 0.0,
    )  # fmt: skip
    out = decode(encode(msg)).encoder_inputs[f.identifier].pixel_values
    assert out.dtype == np.uint8 and out.flags.c_contiguous
    np.testing.assert_array_equal(out, base)


def test_uint8_pixels_and_their_normalization_round_trip():
    f = feature(0, offset=0)
    item = EncoderInput(pixels(f.grid_thw, 1), f.grid_thw, CLIP_VIDEO_NORMALIZATION)
    msg = EngineCoreRequest(
        "r", [0] * f.num_embeds, [f], {f.identifier: item}, SamplingParams(), None, 0, None,
        None, 0.0,
    )  # fmt: skip
    got = decode(encode(msg))
    assert_same(got, msg)
    assert got.encoder_inputs[f.identifier].normalization == CLIP_VIDEO_NORMALIZATION


def test_numpy_scalars_among_plain_ints_travel_as_ints():
    msg = engine_core_request(0)
    ids = np.arange(len(msg.prompt_token_ids), dtype=np.int64)
    fields = {name: getattr(msg, name) for name in msg.__struct_fields__}
    with_np = EngineCoreRequest(**{**fields, "prompt_token_ids": list(ids)})
    out = decode(encode(with_np))
    assert out.prompt_token_ids == ids.tolist()
    assert all(type(t) is int for t in out.prompt_token_ids)


def test_encode_refuses_what_is_not_a_message():
    with pytest.raises(WireError, match="not a wire message"):
        encode(SamplingParams())  # a part, not a message
    with pytest.raises(WireError, match="not a wire message"):
        encode({"request_id": "r"})


def test_encode_refuses_arrays_and_values_that_are_not_plain_data():
    msg = engine_core_request(1)
    pixels_field = next(iter(msg.encoder_inputs.values()))
    # bypass the message's own check to reach the codec's: numpy would pickle an object array
    msgspec.structs.force_setattr(
        pixels_field, "pixel_values", np.empty(pixels_field.pixel_values.shape, dtype=object)
    )
    with pytest.raises(WireError, match="dtype object cannot travel"):
        encode(msg)
    msgspec.structs.force_setattr(msg, "prompt_token_ids", [1, 2, object()])
    with pytest.raises(WireError, match="object values cannot travel"):
        encode(msg)
    big_seed = SamplingParams()
    msgspec.structs.force_setattr(big_seed, "seed", 2**64)  # past its own check
    msg = EngineCoreRequest("r", [], [], {}, big_seed, None, 0, None, None, 0.0)
    with pytest.raises(WireError, match="cannot encode EngineCoreRequest"):
        encode(msg)


def test_arrays_of_more_than_eight_dims_do_not_travel():
    msg = engine_core_request(0)
    msgspec.structs.force_setattr(msg, "mrope_positions", np.zeros((1,) * 9, dtype=np.int64))
    with pytest.raises(WireError, match="9 dimensions"):
        encode(msg)
