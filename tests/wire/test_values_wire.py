"""The engine's value types cross the process boundary as themselves: a request's items and
pixels, its SamplingParams, updates with logprobs and failures, the core's stats."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest

from mmserve.errors import FailureKind, InvalidRequestError, RequestFailure
from mmserve.metrics import EngineMetrics, SchedulerStats, record_scheduler_stats
from mmserve.multimodal import (
    EncoderInput,
    MultiModalFeature,
    PlaceholderRange,
    ProcessedPrompt,
)
from mmserve.processing.image_processor import ImageProcessorConfig, process_image
from mmserve.sampling_params import SamplingParams
from mmserve.structured_output.params import StructuredOutputParams
from mmserve.updates import Logprobs, RequestStatus, RequestUpdate
from mmserve.wire import (
    EngineCoreOutputs,
    EngineCoreRequest,
    WireError,
    decode,
    encode,
)
from tests.support.factory import CLIP_NORMALIZATION, random_image, uint8_patches
from tests.support.factory import CLIP_VIDEO_NORMALIZATION as NORM_VIDEO
from tests.support.fake_runner import image
from tests.wire.samples import logprobs, positions

PIXEL_WIDTH = 6  # narrow pixel rows keep the workload fast; the codec does not care


def _through_wire(msg):
    return decode([bytes(f) for f in encode(msg)])


# ---------------------------------------------------------------- a request's items


def _image(
    identifier: str, offset: int, length: int, seed: int
) -> tuple[MultiModalFeature, EncoderInput]:
    """An image item and its pixels: grid (1, 2, 2 * length), 4 * length patches merged 2x2."""
    feature = image(identifier, offset, length)
    pixels = uint8_patches(4 * length, PIXEL_WIDTH, seed)
    return feature, EncoderInput(pixels, feature.grid_thw, CLIP_NORMALIZATION)


def _prompt() -> ProcessedPrompt:
    (a, a_pixels), (b, b_pixels) = _image("a" * 64, 2, 4, seed=1), _image("b" * 64, 8, 3, seed=2)
    again = msgspec.structs.replace(a, placeholder=PlaceholderRange(12, 4))
    return ProcessedPrompt(
        prompt_token_ids=list(range(20)),
        mm_features=[a, b, again],
        mrope_positions=positions(20, delta=-6),
        mrope_position_delta=-6,
        prompt="not sent",
        mm_data={a.identifier: a_pixels, b.identifier: b_pixels},
    )


def test_a_request_round_trips_with_one_pixel_frame_per_distinct_item():
    params = SamplingParams(temperature=0.5, seed=2**63 - 1, stop=["x"], stop_token_ids=[9])
    msg = EngineCoreRequest.of("r1", _prompt(), params, arrival_time_s=7.5, cache_salt="s")
    msg = msgspec.structs.replace(msg, eos_token_ids=(2,))
    assert list(msg.encoder_inputs) == ["a" * 64, "b" * 64]  # a is sent once
    assert len(encode(msg)) == 1 + 2 + 1  # header, two pixel frames, positions

    got_msg = _through_wire(msg)
    got = got_msg.prompt()
    original = _prompt()
    assert (got_msg.request_id, got_msg.sampling_params, got_msg.cache_salt) == ("r1", params, "s")
    assert type(got_msg.sampling_params) is SamplingParams  # the value itself, no twin
    assert (got_msg.eos_token_ids, got_msg.arrival_time_s) == ((2,), 7.5)
    assert got.prompt_token_ids == original.prompt_token_ids
    np.testing.assert_array_equal(got.mrope_positions, original.mrope_positions)
    assert got.mrope_position_delta == -6
    assert got.mm_features == original.mm_features  # the specs themselves, no twin
    assert type(got.mm_features[0]) is MultiModalFeature
    assert list(got.mm_data) == list(original.mm_data)
    for identifier, want in original.mm_data.items():
        np.testing.assert_array_equal(got.mm_data[identifier].pixel_values, want.pixel_values)
        assert got.mm_data[identifier].grid_thw == want.grid_thw


def test_a_video_crosses_with_its_modality_and_seconds_per_temporal_patch():
    pixels = uint8_patches(2 * 2 * 4, PIXEL_WIDTH, seed=3)
    video = MultiModalFeature("v" * 64, "video", PlaceholderRange(2, 4), (2, 2, 4))
    data = {video.identifier: EncoderInput(pixels, (2, 2, 4), NORM_VIDEO, 1.0)}
    prompt = ProcessedPrompt(list(range(10)), [video], positions(10), 0, mm_data=data)
    msg = EngineCoreRequest.of("r", prompt, SamplingParams(), arrival_time_s=0.0)
    got_prompt = _through_wire(msg).prompt()
    (got,) = got_prompt.mm_features
    got_pixels = got_prompt.mm_data[got.identifier]
    assert (got.modality, got.grid_thw, got_pixels.second_per_grid_t) == ("video", (2, 2, 4), 1.0)
    np.testing.assert_array_equal(got_pixels.pixel_values, pixels)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="second_per_grid_t"):
            EncoderInput(pixels, (2, 2, 4), NORM_VIDEO, bad)
        forged = EncoderInput(pixels, (2, 2, 4), NORM_VIDEO, 1.0)
        msgspec.structs.force_setattr(forged, "second_per_grid_t", bad)  # past its own check
        forged_msg = msgspec.structs.replace(msg)
        msgspec.structs.force_setattr(forged_msg, "encoder_inputs", {video.identifier: forged})
        with pytest.raises(WireError, match="second_per_grid_t"):
            _through_wire(forged_msg)


def test_items_the_engine_holds_travel_without_pixels():
    prompt = _prompt()
    held = {k: v for k, v in prompt.mm_data.items() if k != "a" * 64}
    msg = EngineCoreRequest.of(
        "r1", dataclasses.replace(prompt, mm_data=held), SamplingParams(), arrival_time_s=0.0
    )
    assert len(encode(msg)) == 1 + 1 + 1
    got = _through_wire(msg).prompt()
    assert [f.identifier in got.mm_data for f in got.mm_features] == [False, True, False]


def test_float_patches_are_refused_where_uint8_levels_are_expected():
    (a, a_pixels) = _image("a" * 64, 2, 4, seed=1)
    levels = a_pixels.pixel_values
    with pytest.raises(ValueError, match="expected uint8 levels"):
        EncoderInput(levels.astype(np.float32), a.grid_thw, CLIP_NORMALIZATION)
    forged = EncoderInput(levels, a.grid_thw, CLIP_NORMALIZATION)
    msgspec.structs.force_setattr(forged, "pixel_values", a_pixels.normalized())  # a float32 sender
    prompt = ProcessedPrompt(list(range(8)), [a], positions(8), 0, mm_data={a.identifier: forged})
    msg = EngineCoreRequest.of("r", prompt, SamplingParams(), arrival_time_s=0.0)
    with pytest.raises(WireError, match="float32, expected uint8 levels"):
        _through_wire(msg)


def test_an_image_crosses_as_one_byte_per_patch_value():
    """The processed 448x448 image's pixel frame: a quarter of its float32 values' bytes."""
    cfg = ImageProcessorConfig()
    data = process_image(random_image(448, 448, seed=4), cfg)
    num_tokens = data.num_patches // 4
    feature = MultiModalFeature("i" * 64, "image", PlaceholderRange(1, num_tokens), data.grid_thw)
    prompt = ProcessedPrompt(
        list(range(num_tokens + 2)), [feature], positions(num_tokens + 2), 0,
        mm_data={feature.identifier: data},
    )  # fmt: skip
    frames = encode(EngineCoreRequest.of("r", prompt, SamplingParams(), arrival_time_s=0.0))
    float32_bytes = data.normalized().nbytes
    assert data.num_patches == 1024 and float32_bytes == 1024 * 1176 * 4
    assert [len(f) for f in frames[1:2]] == [float32_bytes // 4]  # the pixel frame
    got = _through_wire(EngineCoreRequest.of("r", prompt, SamplingParams(), arrival_time_s=0.0))
    np.testing.assert_array_equal(got.prompt().mm_data[feature.identifier].normalized(),
                                  data.normalized())  # fmt: skip


def test_a_text_only_prompt_without_positions_keeps_them_absent():
    prompt = ProcessedPrompt(prompt_token_ids=[1, 2, 3])
    msg = EngineCoreRequest.of("r", prompt, SamplingParams(), arrival_time_s=0.0)
    assert len(encode(msg)) == 1
    assert _through_wire(msg).prompt().mrope_positions is None


# ------------------------------------------------------------------- sampling params


def _request(params: SamplingParams) -> EngineCoreRequest:
    return EngineCoreRequest("r", [1], [], {}, params, None, 0, (), None, 0.0)


def test_sampling_params_cross_as_themselves_with_every_field():
    params = SamplingParams(
        n=3,
        temperature=0.005,  # raised to 0.01 once, at the sender
        top_p=0.9,
        top_k=20,
        seed=-(2**63),
        max_tokens=None,
        min_tokens=2,
        stop="END",
        stop_token_ids=[151645],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        logprobs=5,
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.3,
        logit_bias={151645: -100, 7: 2.5},
    )
    got = _through_wire(_request(params)).sampling_params
    assert got == params and type(got) is SamplingParams
    assert (
        got.temperature == 0.01
        and got.stop == ("END",)
        and got.logit_bias
        == {
            151645: -100.0,
            7: 2.5,
        }
    )
    assert _through_wire(_request(SamplingParams())).sampling_params == SamplingParams()


def test_sampling_values_the_engine_refuses_are_refused_on_arrival():
    frames = [bytes(f) for f in encode(_request(SamplingParams(top_p=0.5)))]
    tree = msgspec.msgpack.decode(frames[0][3:])
    tree[4][2] = 0.0  # sampling_params.top_p
    frames[0] = frames[0][:3] + msgspec.msgpack.encode(tree)
    with pytest.raises(WireError, match="top_p must be in"):
        decode(frames)
    with pytest.raises(InvalidRequestError, match="top_p"):
        msgspec.structs.replace(SamplingParams(), top_p=0.0)


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
    assert _through_wire(_request(params)).sampling_params == params


def test_a_forged_structured_output_is_refused_on_arrival():
    params = SamplingParams(structured_outputs=StructuredOutputParams.choice(["a"]))
    frames = encode(_request(params))
    forged = bytes(frames[0]).replace(b"choice", b"cheese")
    with pytest.raises(WireError, match="cheese|choice"):
        decode([forged])
    empty = bytes(frames[0]).replace(b'["a"]', b"     ")
    with pytest.raises(WireError, match="choice must be a list"):
        decode([empty])


# ------------------------------------------------------------------ engine core -> API


def _lp(num_tokens: int, num_top: int) -> Logprobs:
    return logprobs(num_tokens, num_top)


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
    update = msgspec.structs.replace(update, num_cached_tokens=48, first_scheduled_time_s=801.25)
    (out,) = _through_wire(EngineCoreOutputs([update])).outputs
    assert out == update and type(out) is RequestUpdate
    assert out.error is None or type(out.error.kind) is FailureKind


def test_an_update_with_logprobs_survives_the_wire_exactly() -> None:
    lp = _lp(2, 3)
    update = RequestUpdate("r#1", [5, 6], RequestStatus.FINISHED_LENGTH, logprobs=lp)
    (back,) = _through_wire(EngineCoreOutputs([update])).outputs
    assert back.logprobs is not None
    for name in ("token_ids", "logprobs", "ranks"):
        got, sent = getattr(back.logprobs, name), getattr(lp, name)
        assert got.dtype == sent.dtype and np.array_equal(got, sent), name


@pytest.mark.parametrize(
    "build",
    [
        lambda w: Logprobs(w.token_ids.astype(np.int64), w.logprobs, w.ranks),
        lambda w: Logprobs(w.token_ids, w.logprobs.astype(np.float64), w.ranks),
        lambda w: Logprobs(w.token_ids, w.logprobs[:, :1], w.ranks),
        lambda w: Logprobs(w.token_ids, w.logprobs, w.ranks[:1]),
        lambda w: Logprobs(w.token_ids[:, :0], w.logprobs[:, :0], w.ranks),
        lambda w: Logprobs(-w.token_ids - 1, w.logprobs, w.ranks),
        lambda w: Logprobs(w.token_ids, w.logprobs, w.ranks * 0),
        lambda w: RequestUpdate("r", [1], logprobs=w),  # 2 rows for 1 token
    ],
)
def test_inconsistent_logprobs_are_refused_at_the_sender(build) -> None:
    with pytest.raises(ValueError, match="logprobs"):
        build(_lp(2, 3))


def test_inconsistent_logprobs_are_refused_on_arrival() -> None:
    update = RequestUpdate("r", [1, 2], logprobs=_lp(2, 3))
    frames = [bytes(f) for f in encode(EngineCoreOutputs([update]))]
    tree = msgspec.msgpack.decode(frames[0][3:])
    tree[0][0][1] = [1]  # one new token, two logprob rows
    frames[0] = frames[0][:3] + msgspec.msgpack.encode(tree)
    with pytest.raises(WireError, match="logprobs for 2 tokens"):
        decode(frames)


def test_stats_round_trip_and_reach_the_exported_metrics():
    stats = SchedulerStats(
        6,
        2,
        40,
        12,
        12 * 7168,
        30,
        1000,
        400,
        20,
        5,
        counters={"encoder_items_encoded": 15, "encoder_forward_calls": 7, "num_preemptions": 3},
        gauges={"kv_blocks_total": 64.0},
        modality_counters={"encoder_forward_calls": {"image": 5, "video": 2}},
    )
    msg = _through_wire(EngineCoreOutputs([], stats))
    assert msg.stats == stats and type(msg.stats) is SchedulerStats
    metrics = EngineMetrics()
    record_scheduler_stats(metrics, msg.stats)
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
