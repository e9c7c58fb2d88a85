"""The wire twins mirror the in-process types field for field, and a scheduler driven through
the wire behaves exactly as one driven in process."""

from __future__ import annotations

import dataclasses
import itertools
import random
import zlib
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.errors import FailureKind, InvalidRequestError, RequestFailure
from mmserve.metrics import EngineMetrics
from mmserve.multimodal import (
    MultiModalFeature,
    PlaceholderRange,
    ProcessedImage,
    ProcessedPrompt,
)
from mmserve.sampling_params import SamplingParams
from mmserve.scheduling import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    Request,
    RequestUpdate,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
)
from mmserve.scheduling.outputs import GrammarOutput
from mmserve.scheduling.request import RequestStatus
from mmserve.structured_output.params import StructuredOutputParams
from mmserve.wire import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    WireCachedRequestData,
    WireEncoderInput,
    WireError,
    WireGrammarBitmask,
    WireModelRunnerOutput,
    WireNewRequestData,
    WireRunnerPayload,
    WireSamplingParams,
    WireSchedulerOutput,
    WireStructuredOutputs,
    convert,
    decode,
    encode,
)
from tests.support.fake_runner import FakeRunner, image, make_request, make_scheduler
from tests.wire.samples import positions

PIXEL_WIDTH = 6  # narrow pixel rows keep the workload fast; the codec does not care


def _fields(cls) -> list[str]:
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return list(cls.__struct_fields__)
    return [f.name for f in dataclasses.fields(cls)]


def _through_wire(msg):
    return decode([bytes(f) for f in encode(msg)])


# ------------------------------------------------------------------ the twins' fields


@pytest.mark.parametrize(
    ("wire", "local", "extra"),
    [
        (WireSamplingParams, SamplingParams, set()),
        (WireCachedRequestData, CachedRequestData, set()),
        (WireNewRequestData, NewRequestData, set()),
        (WireSchedulerOutput, SchedulerOutput, {"encoder_inputs", "grammar_bitmask"}),
        (WireModelRunnerOutput, ModelRunnerOutput, set()),
        (
            EngineStats,
            SchedulerStats,
            {"counters", "gauges", "modality_counters", "labelled_counters"},
        ),
    ],
)
def test_a_field_added_in_process_must_be_added_to_its_wire_twin(wire, local, extra):
    assert [f for f in _fields(wire) if f not in extra] == _fields(local)
    assert extra <= set(_fields(wire))


def test_wire_sampling_defaults_are_sampling_params_defaults():
    assert convert.sampling_params_to_wire(SamplingParams()) == WireSamplingParams()


def test_the_runner_payload_travels_whole():
    from mmserve.execution.request_state import RunnerPayload

    assert _fields(WireRunnerPayload) == _fields(RunnerPayload)


# ---------------------------------------------------------------- API <-> engine core


def _image(identifier: str, offset: int, length: int, seed: int) -> MultiModalFeature:
    """An image item with pixels: grid (1, 2, 2 * length), 4 * length patches merged 2x2."""
    feature = image(identifier, offset, length)
    rng = np.random.default_rng(seed)
    pixels = rng.standard_normal((4 * length, PIXEL_WIDTH)).astype(np.float32)
    return dataclasses.replace(feature, data=ProcessedImage(pixels, feature.grid_thw))


def _prompt() -> ProcessedPrompt:
    a, b = _image("a" * 64, 2, 4, seed=1), _image("b" * 64, 8, 3, seed=2)
    features = [
        a,
        b,
        dataclasses.replace(a, placeholder=dataclasses.replace(a.placeholder, offset=12)),
    ]
    return ProcessedPrompt(
        prompt_token_ids=list(range(20)),
        mm_features=features,
        mrope_positions=positions(20, delta=-6),
        mrope_position_delta=-6,
        prompt="not sent",
    )


def test_a_request_round_trips_with_one_pixel_frame_per_distinct_item():
    params = SamplingParams(temperature=0.5, seed=2**63 - 1, stop=["x"], stop_token_ids=[9])
    msg = convert.request_to_wire(
        "r1", _prompt(), params, arrival_time_s=7.5, cache_salt="s", eos_token_ids=(2,)
    )
    assert [i.identifier for i in msg.encoder_inputs] == ["a" * 64, "b" * 64]  # a is sent once
    assert len(encode(msg)) == 1 + 2 + 1  # header, two pixel frames, positions

    add = convert.request_from_wire(_through_wire(msg))
    original = _prompt()
    assert (add.request_id, add.params, add.cache_salt) == ("r1", params, "s")
    assert (add.eos_token_ids, add.arrival_time_s) == ((2,), 7.5)
    assert add.prompt.prompt_token_ids == original.prompt_token_ids
    np.testing.assert_array_equal(add.prompt.mrope_positions, original.mrope_positions)
    assert add.prompt.mrope_position_delta == -6
    for got, want in zip(add.prompt.mm_features, original.mm_features, strict=True):
        assert (got.identifier, got.modality, got.placeholder, got.grid_thw) == (
            want.identifier,
            want.modality,
            want.placeholder,
            want.grid_thw,
        )
        np.testing.assert_array_equal(got.data.pixel_values, want.data.pixel_values)
        assert got.data.grid_thw == want.data.grid_thw


def test_a_video_crosses_with_its_modality_and_seconds_per_temporal_patch():
    rng = np.random.default_rng(3)
    pixels = rng.standard_normal((2 * 2 * 4, PIXEL_WIDTH)).astype(np.float32)
    video = MultiModalFeature(
        "v" * 64, "video", PlaceholderRange(2, 4), ProcessedImage(pixels, (2, 2, 4), 1.0), (2, 2, 4)
    )
    prompt = ProcessedPrompt(list(range(10)), [video], positions(10), 0)
    msg = convert.request_to_wire("r", prompt, SamplingParams(), arrival_time_s=0.0)
    (got,) = convert.request_from_wire(_through_wire(msg)).prompt.mm_features
    assert (got.modality, got.grid_thw, got.data.second_per_grid_t) == ("video", (2, 2, 4), 1.0)
    np.testing.assert_array_equal(got.data.pixel_values, pixels)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(WireError, match="second_per_grid_t"):
            WireEncoderInput("v" * 64, "video", (2, 2, 4), pixels, bad)


def test_items_the_engine_holds_travel_without_pixels():
    msg = convert.request_to_wire(
        "r1", _prompt(), SamplingParams(), arrival_time_s=0.0, held_identifiers={"a" * 64}
    )
    assert len(encode(msg)) == 1 + 1 + 1
    add = convert.request_from_wire(_through_wire(msg))
    assert [f.data is None for f in add.prompt.mm_features] == [True, False, True]


def test_a_text_only_prompt_without_positions_keeps_them_absent():
    prompt = ProcessedPrompt(prompt_token_ids=[1, 2, 3])
    msg = convert.request_to_wire("r", prompt, SamplingParams(), arrival_time_s=0.0)
    assert len(encode(msg)) == 1
    assert convert.request_from_wire(_through_wire(msg)).prompt.mrope_positions is None


def test_sampling_values_the_engine_refuses_are_refused_on_arrival():
    bad = msgspec.structs.replace(WireSamplingParams(), top_p=0.0)
    with pytest.raises(InvalidRequestError, match="top_p"):
        convert.sampling_params_from_wire(bad)


@pytest.mark.parametrize(
    "update",
    [
        RequestUpdate("r", [5, 6]),
        RequestUpdate("r", [7], RequestStatus.FINISHED_STOPPED, stop_reason=151645),
        RequestUpdate("r", [7], RequestStatus.FINISHED_STOPPED),
        RequestUpdate("r", [], RequestStatus.FINISHED_LENGTH),
        RequestUpdate("r", [], RequestStatus.FINISHED_ABORTED),
        RequestUpdate(
            "r",
            [],
            RequestStatus.FINISHED_ERROR,
            error=RequestFailure("4 embeddings, 5 placeholders", FailureKind.REQUEST, "messages"),
        ),
        RequestUpdate(
            "r", [], RequestStatus.FINISHED_ERROR, error=RequestFailure("NaN", FailureKind.INTERNAL)
        ),
    ],
)
def test_updates_round_trip(update):
    update = dataclasses.replace(update, num_cached_tokens=48, first_scheduled_time_s=801.25)
    batch = _through_wire(EngineCoreOutputs([convert.update_to_wire(update)]))
    (out,) = batch.outputs
    assert out.num_cached_tokens == 48
    assert out.first_scheduled_time_s == 801.25
    assert convert.update_from_wire(out) == update


def test_stats_round_trip_and_reach_the_exported_metrics():
    stats = SchedulerStats(6, 2, 40, 12, 12 * 7168, 30, 1000, 400, 20, 5)
    counters = {"encoder_items_encoded": 15, "encoder_forward_calls": 7, "num_preemptions": 3}
    by_modality = {"encoder_forward_calls": {"image": 5, "video": 2}}
    msg = _through_wire(
        convert.stats_to_wire(stats, counters, {"kv_blocks_total": 64.0}, by_modality)
    )
    assert convert.stats_from_wire(msg) == stats
    metrics = EngineMetrics()
    convert.apply_stats(msg, metrics)
    snap = metrics.snapshot()
    assert snap.gauges["num_requests_running"] == 6
    assert snap.gauges["num_requests_waiting"] == 2
    assert snap.gauges["kv_blocks_free"] == 40
    assert snap.gauges["encoder_cache_used_slots"] == 12
    assert snap.gauges["encoder_cache_resident_slots"] == 30
    assert snap.gauges["kv_blocks_total"] == 64
    assert snap.modality_counters["encoder_forward_calls"] == {"image": 5, "video": 2}
    assert snap.counters["prefix_cache_queries"] == 1000
    assert snap.counters["prefix_cache_hits"] == 400
    assert snap.counters["encoder_cache_queries"] == 20
    assert snap.counters["encoder_cache_hits"] == 5
    assert snap.counters["encoder_items_encoded"] == 15
    assert snap.counters["encoder_forward_calls"] == 7
    assert snap.counters["num_preemptions"] == 3


# ------------------------------------------------------------- scheduler <-> executor


@dataclass(frozen=True)
class _Payload:
    """What the engine attaches to a request for the runner (RunnerPayload minus torch)."""

    sampling_params: SamplingParams
    mrope_positions: np.ndarray
    mrope_position_delta: int
    eos_token_ids: tuple[int, ...]


def _payload_from_wire(w: WireRunnerPayload) -> _Payload:
    params = convert.sampling_params_from_wire(w.sampling_params)
    return _Payload(params, w.mrope_positions, w.mrope_position_delta, w.eos_token_ids)


def test_the_receiving_side_gets_the_seed_and_no_random_state():
    from mmserve.execution.request_state import RunnerPayload, payload_from_wire

    payload = RunnerPayload(SamplingParams(seed=1234), positions(5), 0, (2,))
    new = NewRequestData("r", [1, 2, 3, 4, 5], [], [0], 0, payload)
    so = SchedulerOutput([new], [], {"r": 5}, 5, {}, [], frozenset(), frozenset())
    step = convert.scheduler_output_from_wire(
        _through_wire(convert.scheduler_output_to_wire(so, lambda rid: [])), payload_from_wire
    )
    (got,) = step.scheduler_output.scheduled_new_reqs
    assert got.payload.sampling_params == payload.sampling_params
    assert got.payload.sampling_params.seed == 1234
    np.testing.assert_array_equal(got.payload.mrope_positions, payload.mrope_positions)
    assert got.payload.eos_token_ids == payload.eos_token_ids


EOS = 2


def _request(rng: random.Random, rid: str) -> Request:
    """A random prompt with up to three images (some repeated across requests) and pixels."""
    num_prompt = rng.randrange(4, 90)
    images, pos = [], rng.randrange(0, 10)
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        ident = rng.randrange(6)
        size = 4 + ident * 3
        if pos + size > num_prompt:
            break
        images.append((f"{ident:064x}", pos, size))
        pos += size + rng.randrange(0, 8)
    request = make_request(
        rid,
        num_prompt,
        images,
        text_seed=rng.choice([0, 0, 1]),
        max_tokens=rng.randrange(1, 20),
        ignore_eos=rng.random() < 0.2,
    )
    request.mm_features = [
        _image(f.identifier, f.placeholder.offset, f.placeholder.length, seed=int(f.identifier, 16))
        for f in request.mm_features
    ]
    params = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=rng.choice([None, 7]))
    request.payload = _Payload(params, positions(num_prompt, delta=3), 3, (EOS,))
    return request


class _WireRunner:
    """The FakeRunner behind the wire: every step and answer is encoded, sent, decoded."""

    def __init__(self, inner: FakeRunner, scheduler: Scheduler) -> None:
        self.inner = inner
        self.scheduler = scheduler
        self.num_pixel_frames = 0

    def execute(
        self, so: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        requests = self.scheduler.requests
        wire = convert.scheduler_output_to_wire(
            so, lambda rid: requests[rid].mm_features, grammar_output
        )
        frames = [bytes(f) for f in encode(wire)]
        step = convert.scheduler_output_from_wire(decode(frames), _payload_from_wire)
        self._check_pixels(so, step)
        self.num_pixel_frames += len(step.encoder_inputs)
        answer = self.inner.execute(step.scheduler_output, step.grammar_output)
        out = decode(encode(convert.runner_output_to_wire(answer)))
        return convert.runner_output_from_wire(out)

    def _check_pixels(self, so: SchedulerOutput, step: convert.StepInputs) -> None:
        """Pixels come for exactly the items encoded this step, and equal the sender's."""
        scheduled = {
            f.identifier: f
            for rid, idxs in so.scheduled_encoder_inputs.items()
            for f in (self.scheduler.requests[rid].mm_features[i] for i in idxs)
        }
        assert set(step.encoder_inputs) == set(scheduled)
        for identifier, pixels in step.encoder_inputs.items():
            np.testing.assert_array_equal(
                pixels.pixel_values, scheduled[identifier].data.pixel_values
            )
        for new in step.scheduler_output.scheduled_new_reqs:
            original = self.scheduler.requests[new.request_id]
            assert _same_payload(new.payload, original.payload)
            for f in new.mm_features:
                assert (f.data is not None) == (f.identifier in step.encoder_inputs)


def _same_payload(a: _Payload, b: _Payload) -> bool:
    return (
        a.sampling_params == b.sampling_params
        and np.array_equal(a.mrope_positions, b.mrope_positions)
        and (a.mrope_position_delta, a.eos_token_ids) == (b.mrope_position_delta, b.eos_token_ids)
    )


def _run_workload(seed: int, through_wire: bool) -> tuple[list[tuple], int]:
    """Random arrivals, aborts and runner errors on tiny budgets (chunking, preemption)."""
    rng = random.Random(seed)
    config = SchedulerConfig(
        max_model_len=96, max_num_batched_tokens=32, max_num_seqs=5, max_tokens_per_mm_item=20
    )
    clock = itertools.count(1000.0, 0.5)  # a step clock: both runs stamp the same times
    scheduler = make_scheduler(
        config,
        CacheConfig(num_blocks=24, block_size=4),
        eos_token_ids=[EOS],
        clock=lambda: next(clock),
    )

    def sample(rid: str, pos: int) -> int:
        r = random.Random(f"{seed}:{rid}:{pos}")
        return EOS if r.random() < 0.1 else r.randrange(3, 500)

    fake = FakeRunner(config.effective_encoder_cache_size, 4, sample)
    runner = _WireRunner(fake, scheduler) if through_wire else fake
    trace, num_requests = [], 0
    for step in range(2_000):
        if step >= 150 and not scheduler.has_unfinished_requests():
            break
        for _ in range(rng.choice([0, 0, 1, 2]) if step < 150 else 0):
            scheduler.add_request(_request(rng, f"r{num_requests}"))
            num_requests += 1
        if scheduler.requests and rng.random() < 0.04:
            scheduler.finish_requests(
                rng.choice(sorted(scheduler.requests)), RequestStatus.FINISHED_ABORTED
            )
        fake.fail_ids = {
            r for r in scheduler.requests if zlib.crc32(f"{seed}{r}".encode()) % 30 == 0
        }
        so = scheduler.schedule()
        updates = scheduler.update_from_output(so, runner.execute(so))
        scheduler.check_integrity()
        trace.append(
            (
                so.num_scheduled_tokens,
                so.scheduled_encoder_inputs,
                so.free_encoder_identifiers,
                so.finished_req_ids,
                so.preempted_req_ids,
                [(r.request_id, r.num_computed_tokens) for r in so.scheduled_new_reqs],
                updates,
            )
        )
    else:
        raise AssertionError("the workload never drained")
    num_pixel_frames = runner.num_pixel_frames if through_wire else 0
    return trace, num_pixel_frames


@pytest.mark.parametrize("seed", [0, 1])
def test_a_scheduler_driven_through_the_wire_takes_exactly_the_same_steps(seed):
    direct, _ = _run_workload(seed, through_wire=False)
    wired, num_pixel_frames = _run_workload(seed, through_wire=True)
    assert wired == direct
    # the workload exercised what the wire must carry
    assert num_pixel_frames > 20
    assert any(step[4] for step in direct), "no preemption happened"
    assert any(step[6] and any(u.error for u in step[6]) for step in direct), "no runner error"
    cached_encodes = [
        rid for step in direct for rid in step[1] if rid not in {r for r, _ in step[5]}
    ]
    assert cached_encodes, "no item of an already running request was encoded"


# ------------------------------------------------------------------ structured output


@pytest.mark.parametrize(
    "so",
    [
        StructuredOutputParams.json({"type": "object", "properties": {"a": {"enum": [1, 2]}}}),
        StructuredOutputParams.json_object(),
        StructuredOutputParams.regex(r"[0-9]{3}"),
        StructuredOutputParams.choice(["yes", "no"]),
        StructuredOutputParams.grammar('start: "a" | "b"'),
    ],
)
def test_structured_outputs_cross_the_wire(so):
    params = SamplingParams(temperature=0.0, structured_outputs=so)
    wire = _through_wire(
        EngineCoreRequest("r", [1], [], [], convert.sampling_params_to_wire(params), None, 0,
                          (), None, 0.0)
    )  # fmt: skip
    assert convert.sampling_params_from_wire(wire.sampling_params) == params


def test_a_forged_structured_output_kind_is_refused_on_arrival():
    wire = convert.sampling_params_to_wire(
        SamplingParams(structured_outputs=StructuredOutputParams.choice(["a"]))
    )
    frames = encode(EngineCoreRequest("r", [1], [], [], wire, None, 0, (), None, 0.0))
    forged = bytes(frames[0]).replace(b"choice", b"cheese")
    with pytest.raises(WireError, match="cheese|choice|Invalid enum"):
        decode([forged])
    empty = msgspec.structs.replace(wire, structured_outputs=WireStructuredOutputs("regex", ""))
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        convert.sampling_params_from_wire(empty)


def test_the_grammar_bitmask_crosses_the_executor_wire():
    bitmask = np.array([[-1, 5], [0, 2**31 - 1]], dtype=np.int32)
    so = SchedulerOutput([], [], {"a": 1, "b": 1}, 2, {}, [], frozenset(), frozenset())
    grammar = GrammarOutput(("a", "b"), bitmask)
    back = convert.scheduler_output_from_wire(
        _through_wire(convert.scheduler_output_to_wire(so, lambda r: [], grammar)), lambda p: p
    ).grammar_output
    assert back.request_ids == ("a", "b")
    np.testing.assert_array_equal(back.bitmask, bitmask)
    with pytest.raises(WireError, match="int32"):
        WireGrammarBitmask(["a"], np.zeros((1, 2), np.int64))
