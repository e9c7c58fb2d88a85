"""Malformed, truncated or forged frames raise WireError and nothing else, quickly."""

from __future__ import annotations

import contextlib
import random
import time

import msgspec
import numpy as np
import pytest

from mmserve.errors import FailureKind, RequestFailure
from mmserve.sampling_params import SamplingParams
from mmserve.updates import RequestStatus, RequestUpdate
from mmserve.wire import (
    ALLOWED_DTYPES,
    EngineCoreOutputs,
    EngineCoreRequest,
    WireError,
    decode,
    encode,
)
from mmserve.wire.codec import HEADER_BYTES, MAGIC, VERSION
from tests.wire.samples import (
    all_messages,
    engine_core_request,
    engine_stats,
    remote_items_request,
)

MESSAGES = all_messages()
IDS = [name for name, _ in MESSAGES]


def _frames(msg) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


def _tree(frames: list[bytes]):
    """The body as untyped msgpack values (lists, dicts, scalars), to forge from."""
    return msgspec.msgpack.decode(frames[0][HEADER_BYTES:])


def _with_tree(frames: list[bytes], tree) -> list[bytes]:
    return [frames[0][:HEADER_BYTES] + msgspec.msgpack.encode(tree), *frames[1:]]


def _decodes_or_wire_error(frames) -> None:
    with contextlib.suppress(WireError):
        decode(frames)


def _array_ref_paths(node, path=()) -> list[tuple]:
    """Paths of every [dtype, shape, frame_idx] list in the untyped body, in encoding order."""
    if isinstance(node, list):
        if len(node) == 3 and isinstance(node[0], str) and node[0] in ALLOWED_DTYPES:
            return [path]
        return [p for i, child in enumerate(node) for p in _array_ref_paths(child, (*path, i))]
    if isinstance(node, dict):
        return [p for k, child in node.items() for p in _array_ref_paths(child, (*path, k))]
    return []


def _get(node, path):
    for key in path:
        node = node[key]
    return node


def _leaves(node, path=()):
    """(path, value) of every scalar in the untyped body."""
    if isinstance(node, list):
        for i, child in enumerate(node):
            yield from _leaves(child, (*path, i))
    elif isinstance(node, dict):
        for key, child in node.items():
            yield from _leaves(child, (*path, key))
    else:
        yield path, node


def _replace(node, path, value):
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


# ---------------------------------------------------------------------------- header


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "no frames"),
        ([b""], "needs at least"),
        ([bytes((MAGIC, VERSION))], "needs at least"),
        ([bytes((0x80, VERSION, 1)) + b"\x90"], "not ours"),
        ([bytes((MAGIC, VERSION + 1, 1)) + b"\x90"], "version"),
        ([bytes((MAGIC, VERSION, 0)) + b"\x90"], "unknown message tag 0"),
        ([bytes((MAGIC, VERSION, 255)) + b"\x90"], "unknown message tag 255"),
        ([None], "not a buffer"),
        (["text"], "not a buffer"),
        ([bytes((MAGIC, VERSION, 2))], "truncated"),
        # a msgpack array header claiming 4 billion items, in 5 bytes: no allocation
        ([bytes((MAGIC, VERSION, 2)) + b"\xdd\xff\xff\xff\xff"], "truncated"),
    ],
)
def test_bad_header_or_frames(frames, match):
    with pytest.raises(WireError, match=match):
        decode(frames)


def test_deeply_nested_body_is_an_error_not_a_crash():
    deep = b"\x91" * 200_000 + b"\xc0"  # [[[...[None]...]]]
    with pytest.raises(WireError):
        decode([bytes((MAGIC, VERSION, 2)) + deep])


def test_a_non_contiguous_buffer_frame_is_refused():
    strided = memoryview(np.arange(16, dtype=np.uint8).reshape(4, 4)[:, ::2])
    frames = _frames(engine_core_request(0))
    with pytest.raises(WireError, match="not a contiguous buffer"):
        decode([frames[0], strided])
    with pytest.raises(WireError, match="not a contiguous buffer"):
        decode([memoryview(frames[0] + frames[0])[::2]])


# ------------------------------------------------------------------- truncate / frames


@pytest.mark.parametrize(("name", "msg"), MESSAGES, ids=IDS)
def test_every_truncation_of_every_frame_is_an_error(name, msg):
    rng = random.Random(name)
    frames = _frames(msg)
    for i, frame in enumerate(frames):
        if not frame:
            continue  # an empty array's frame has nothing to cut
        for cut in {0, len(frame) - 1, *(rng.randrange(len(frame)) for _ in range(16))}:
            broken = [*frames[:i], frame[:cut], *frames[i + 1 :]]
            with pytest.raises(WireError):
                decode(broken)


@pytest.mark.parametrize(("name", "msg"), MESSAGES, ids=IDS)
def test_a_frame_too_many_or_too_few_is_an_error(name, msg):
    frames = _frames(msg)
    for extra in (b"", b"\x00" * 8, frames[0]):
        with pytest.raises(WireError):
            decode([*frames, extra])
    for i in range(1, len(frames)):
        with pytest.raises(WireError, match="frame"):
            decode(frames[:i] + frames[i + 1 :])


def test_swapped_array_frames_are_an_error():
    frames = _frames(engine_core_request(2))
    assert len(frames) == 4  # header, pixels, pixels, positions
    with pytest.raises(WireError, match="bytes"):
        decode([frames[0], frames[3], frames[2], frames[1]])


# -------------------------------------------------------------------- forged array refs

FORGED_REFS = [
    ("dtype complex", lambda ref: ["<c8", ref[1], ref[2]], "not one of"),
    ("dtype object", lambda ref: ["|O", ref[1], ref[2]], "not one of"),
    ("dtype big-endian", lambda ref: [">" + ref[0][1:], ref[1], ref[2]], "not one of"),
    ("dtype not a string", lambda ref: [4, ref[1], ref[2]], "not one of"),
    (
        "dtype other size",
        lambda ref: ["<i2" if ref[0] != "<i2" else "<i4", ref[1], ref[2]],
        "bytes",
    ),
    ("negative dim", lambda ref: [ref[0], [-1, *ref[1]], ref[2]], "dims >= 0"),
    ("dim not int", lambda ref: [ref[0], ["3", *ref[1][1:]], ref[2]], "dims >= 0"),
    ("dim bool", lambda ref: [ref[0], [True, *ref[1]], ref[2]], "dims >= 0"),
    ("too many dims", lambda ref: [ref[0], [1] * 9 + ref[1], ref[2]], "at most 8"),
    ("shape too big", lambda ref: [ref[0], [2, *ref[1]], ref[2]], "bytes"),
    ("shape huge", lambda ref: [ref[0], [2**62, 2**62], ref[2]], "bytes"),
    ("shape not list", lambda ref: [ref[0], "3x4", ref[2]], "dims >= 0"),
    ("frame out of range", lambda ref: [ref[0], ref[1], 99], "frame 99"),
    ("frame 0 (the header)", lambda ref: [ref[0], ref[1], 0], "frame 0"),
    ("frame negative", lambda ref: [ref[0], ref[1], -1], "frame -1"),
    ("frame not int", lambda ref: [ref[0], ref[1], "1"], "frame '1'"),
    ("ref too short", lambda ref: ref[:2], r"\[dtype, shape, frame_idx\]"),
    ("ref not a list", lambda ref: "array", r"\[dtype, shape, frame_idx\]"),
]


@pytest.mark.parametrize(("label", "forge", "match"), FORGED_REFS, ids=[f[0] for f in FORGED_REFS])
def test_forged_array_reference_is_an_error(label, forge, match):
    for msg in (engine_core_request(2), remote_items_request()):
        frames = _frames(msg)
        paths = _array_ref_paths(_tree(frames))
        assert paths, "the sample carries arrays"
        for path in paths:
            tree = _tree(frames)
            _replace(tree, path, forge(list(_get(tree, path))))
            with pytest.raises(WireError, match=match):
                decode(_with_tree(frames, tree))


# --------------------------------------------------------------------------- fuzzing


@pytest.mark.parametrize(("name", "msg"), MESSAGES, ids=IDS)
def test_flipped_bytes_in_the_body_decode_or_raise_wire_error(name, msg):
    rng = random.Random(name)
    frames = _frames(msg)
    head = frames[0]
    for _ in range(300):
        body = bytearray(head)
        for _ in range(rng.randint(1, 3)):
            body[rng.randrange(HEADER_BYTES, len(body)) if len(body) > HEADER_BYTES else 0] ^= (
                rng.randint(1, 255)
            )
        _decodes_or_wire_error([bytes(body), *frames[1:]])


LEAF_VALUES = [
    None,
    True,
    -1,
    0,
    2**64 - 1,
    -(2**63),
    1.5,
    float("nan"),
    "",
    "x" * 70,
    b"\x00",
    [],
    {},
]


@pytest.mark.parametrize(("name", "msg"), MESSAGES, ids=IDS)
def test_any_field_forged_to_any_type_decodes_or_raises_wire_error(name, msg):
    rng = random.Random(name)
    frames = _frames(msg)
    paths = [path for path, _ in _leaves(_tree(frames))]
    for path in rng.sample(paths, min(len(paths), 60)):
        for value in LEAF_VALUES:
            tree = _tree(frames)
            _replace(tree, path, value)
            _decodes_or_wire_error(_with_tree(frames, tree))


def test_forged_field_types_are_named_in_the_error():
    frames = _frames(engine_core_request(1))
    tree = _tree(frames)
    tree[1][0] = "seven"  # prompt_token_ids[0]
    with pytest.raises(WireError, match=r"Expected `int`, got `str` - at `\$\[1\]\[0\]`"):
        decode(_with_tree(frames, tree))
    tree = _tree(frames)
    tree[1][0] = -5
    with pytest.raises(WireError, match=">= 0"):
        decode(_with_tree(frames, tree))
    tree = _tree(frames)
    tree.append(1)  # a field the struct does not have
    with pytest.raises(WireError, match="at most length"):
        decode(_with_tree(frames, tree))


def test_fuzzing_is_fast():
    """Decoding garbage costs about what decoding a message costs: no slow failure path."""
    frames = _frames(engine_core_request(2))
    start = time.perf_counter()
    for i in range(2_000):
        cut = [frames[0][: len(frames[0]) * i // 2_000], *frames[1:]]
        with pytest.raises(WireError):
            decode(cut)
    assert time.perf_counter() - start < 5.0


# ---------------------------------------------------------------- the messages' own rules


def _forge(msg, edit) -> list[bytes]:
    frames = _frames(msg)
    tree = _tree(frames)
    edit(tree)
    return _with_tree(frames, tree)


def _set(path, value):
    return lambda tree: _replace(tree, path, value)


SEMANTIC = [
    # EngineCoreRequest fields: 0 id, 1 tokens, 2 features, 3 encoder inputs, 5 positions
    ("empty request id", engine_core_request, _set((0,), ""), "length >= 1"),
    # a feature: 0 identifier, 1 modality, 2 placeholder [offset, length], 3 grid_thw;
    # encoder inputs: identifier -> [pixel_values, grid_thw, second_per_grid_t]
    (
        "placeholder past prompt",
        engine_core_request,
        _set((2, 0, 2, 0), 10_000),
        "covers positions",
    ),
    ("item length 0", engine_core_request, _set((2, 0, 2, 1), 0), ">= 1"),
    ("grid of 0", engine_core_request, _set((2, 0, 3, 1), 0), ">= 1"),
    (
        "pixels of no item",
        engine_core_request,
        lambda t: _rekey_first(t[3], "f" * 64),
        "matches none",
    ),
    (
        "pixels for another grid",
        engine_core_request,
        lambda t: _first(t[3]).__setitem__(1, [1, 4, 7]),
        r"\[28, patch",
    ),
    # the same bytes as int64 (3, 28), read with another shape or dtype
    ("positions shape", engine_core_request, _set((5, 1), [2, 42]), r"int64 \(2, 42\), expected"),
    ("positions dtype", engine_core_request, _set((5, 0), "<f8"), r"float64 \(3, 28\), expected"),
    ("token id too large", engine_core_request, _set((1, 0), 2**31), "<= 2147483647"),
    # RequestUpdate fields: 2 finish_status, 4 error (its 1: kind), 6 first_scheduled_time_s
    ("finish reason unknown", lambda: _outputs(), _set((0, 0, 2), "done"), "Invalid enum value"),
    ("finish while running", lambda: _outputs(), _set((0, 0, 2), "running"), "not a finished"),
    ("error without reason", lambda: _outputs(), _set((0, 0, 2), None), "an error comes exactly"),
    ("failure kind unknown", lambda: _outputs(), _set((0, 0, 4, 1), "user"), "Invalid enum value"),
    ("scheduled before 0", lambda: _outputs(), _set((0, 0, 6), -1.0), "finite and >= 0"),
    ("scheduled at NaN", lambda: _outputs(), _set((0, 0, 6), float("nan")), "finite and >= 0"),
    ("scheduled at inf", lambda: _outputs(), _set((0, 0, 6), float("inf")), "finite and >= 0"),
    # SchedulerStats (EngineCoreOutputs field 1): 0 num_running, 13 counters
    ("unknown counter", lambda: _stats(), lambda t: t[1][13].__setitem__("made_up", 1), "unknown"),
    ("negative gauge count", lambda: _stats(), _set((1, 0), -1), ">= 0"),
    # SamplingParams (EngineCoreRequest field 4) runs its own checks on arrival
    ("sampling top_p 0", engine_core_request, _set((4, 2), 0.0), "top_p must be in"),
    ("sampling n 0", engine_core_request, _set((4, 0), 0), "n must be in"),
]


def _first(mapping: dict):
    return next(iter(mapping.values()))


def _rekey_first(mapping: dict, key: str) -> None:
    """The first entry under another key, order kept (array frames are referenced in order)."""
    items = list(mapping.items())
    mapping.clear()
    mapping.update([(key, items[0][1]), *items[1:]])


def _stats():
    return EngineCoreOutputs([], engine_stats())


def _outputs():
    failure = RequestFailure("x", FailureKind.REQUEST)
    error = RequestStatus.FINISHED_ERROR
    return EngineCoreOutputs(
        [RequestUpdate("r", [], error, error=failure, first_scheduled_time_s=1.5)]
    )


@pytest.mark.parametrize(
    ("label", "build", "edit", "match"), SEMANTIC, ids=[s[0] for s in SEMANTIC]
)
def test_a_message_that_breaks_its_own_rules_is_an_error(label, build, edit, match):
    assert decode(_frames(build())) is not None  # the unforged message is fine
    with pytest.raises(WireError, match=match):
        decode(_forge(build(), edit))


def test_constructing_a_message_that_breaks_its_rules_fails_at_the_sender():
    msg = engine_core_request(1)
    with pytest.raises(WireError, match="mrope_positions"):
        EngineCoreRequest(
            "r",
            [1, 2],
            [],
            {},
            SamplingParams(),
            np.zeros((3, 5), np.int64),
            0,
            None,
            None,
            0.0,
        )
    # the values inside an envelope check themselves too (a ValueError: they know no wire)
    with pytest.raises(ValueError, match="an error comes exactly"):
        RequestUpdate("r", [1], RequestStatus.FINISHED_ERROR)
    with pytest.raises(ValueError, match="first_scheduled_time_s"):
        RequestUpdate("r", [1], first_scheduled_time_s=float("nan"))
    assert msg.mm_features
