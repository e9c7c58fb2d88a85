"""Between the wire messages and the in-process types they mirror; no torch on either side.

A receiving executor passes `make_payload`, which builds the runner's `RunnerPayload` (this
module does not import `execution/`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Container, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple, Protocol

import msgspec
import numpy as np

from mmserve.errors import FailureKind, RequestFailure
from mmserve.metrics import EngineMetrics, record_scheduler_stats
from mmserve.multimodal import (
    MultiModalFeature,
    PlaceholderRange,
    ProcessedImage,
    ProcessedPrompt,
    RemoteItem,
)
from mmserve.sampling_params import SamplingParams
from mmserve.scheduling.outputs import (
    CachedRequestData,
    GrammarOutput,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    RequestUpdate,
    SchedulerOutput,
    SchedulerStats,
)
from mmserve.scheduling.request import FINISH_REASONS
from mmserve.structured_output.params import StructuredOutputParams
from mmserve.wire.common import (
    WireEncoderInput,
    WireError,
    WireLogprobs,
    WireMMFeature,
    WireRemoteItem,
    WireRequestFailure,
    WireSamplingParams,
    WireStructuredOutputs,
)
from mmserve.wire.engine_core import EngineCoreOutput, EngineCoreRequest, EngineStats
from mmserve.wire.executor import (
    WireCachedRequestData,
    WireGrammarBitmask,
    WireModelRunnerOutput,
    WireNewRequestData,
    WireRemoteEncoderInput,
    WireRunnerPayload,
    WireSchedulerOutput,
)

_STATUS_BY_REASON = MappingProxyType({reason: s for s, reason in FINISH_REASONS.items()})


class RunnerPayloadLike(Protocol):
    """The fields of `execution.request_state.RunnerPayload`."""

    sampling_params: SamplingParams
    mrope_positions: np.ndarray
    mrope_position_delta: int
    eos_token_ids: tuple[int, ...]


class AddRequest(NamedTuple):
    """An EngineCoreRequest back in the engine's terms (the arguments of `add_request`)."""

    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    cache_salt: str | None
    eos_token_ids: tuple[int, ...] | None
    arrival_time_s: float


class StepInputs(NamedTuple):
    """A decoded step: the SchedulerOutput, and the pixels of the items it encodes by identifier.

    Items of cached requests come without data (the runner holds their features from an
    earlier step): an executor takes the pixels of every item it encodes from `encoder_inputs`.
    """

    scheduler_output: SchedulerOutput
    encoder_inputs: dict[str, ProcessedImage]
    grammar_output: GrammarOutput | None = None


# ------------------------------------------------------------------ items and sampling


def feature_to_wire(f: MultiModalFeature) -> WireMMFeature:
    p = f.placeholder
    return WireMMFeature(f.identifier, f.modality, p.offset, p.length, f.grid_thw)


def encoder_input_to_wire(f: MultiModalFeature) -> WireEncoderInput | None:
    """The item's pixels for an encoder, or None when the feature holds none."""
    if not isinstance(f.data, ProcessedImage):
        return None  # no data, or a RemoteItem (`remote_item_to_wire`)
    data = f.data
    return WireEncoderInput(
        f.identifier, f.modality, data.grid_thw, data.pixel_values, data.second_per_grid_t
    )


def remote_item_to_wire(identifier: str, item: RemoteItem) -> WireRemoteItem:
    """The payload becomes a uint8 array over the same bytes (no copy): a raw frame."""
    payload = None if item.payload is None else np.frombuffer(item.payload, dtype=np.uint8)
    return WireRemoteItem(
        identifier,
        item.source,
        payload,
        item.url,
        item.rgb_size,
        item.min_pixels,
        item.max_pixels,
        item.grid_thw,
        item.content_digest,
    )


def remote_item_from_wire(w: WireRemoteItem) -> RemoteItem:
    """Raises WireError where the fields break RemoteItem's own rules."""
    try:
        return RemoteItem(
            source=w.source,
            payload=None if w.payload is None else w.payload.tobytes(),
            url=w.url,
            rgb_size=None if w.rgb_size is None else (w.rgb_size[0], w.rgb_size[1]),
            min_pixels=w.min_pixels,
            max_pixels=w.max_pixels,
            grid_thw=(w.grid_thw[0], w.grid_thw[1], w.grid_thw[2]),
            content_digest=w.content_digest,
        )
    except ValueError as e:
        raise WireError(f"remote item {w.identifier[:16]}: {e}") from None


def feature_from_wire(
    f: WireMMFeature, data: ProcessedImage | RemoteItem | None
) -> MultiModalFeature:
    placeholder = PlaceholderRange(f.offset, f.length)
    return MultiModalFeature(f.identifier, f.modality, placeholder, data, tuple(f.grid_thw))


def sampling_params_to_wire(p: SamplingParams) -> WireSamplingParams:
    fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    so = p.structured_outputs
    fields["structured_outputs"] = None if so is None else WireStructuredOutputs(so.kind, so.spec)
    if fields["logit_bias"] is not None:
        fields["logit_bias"] = dict(fields["logit_bias"])
    return WireSamplingParams(**fields)


def sampling_params_from_wire(w: WireSamplingParams) -> SamplingParams:
    """Raises InvalidRequestError where the values break SamplingParams' own rules."""
    fields = msgspec.structs.asdict(w)
    so = w.structured_outputs
    fields["structured_outputs"] = None if so is None else StructuredOutputParams(so.kind, so.spec)
    return SamplingParams(**fields)


def logprobs_to_wire(lp: Logprobs | None) -> WireLogprobs | None:
    return None if lp is None else WireLogprobs(lp.token_ids, lp.logprobs, lp.ranks)


def logprobs_from_wire(w: WireLogprobs | None) -> Logprobs | None:
    return None if w is None else Logprobs(w.token_ids, w.logprobs, w.ranks)


def failure_to_wire(failure: RequestFailure) -> WireRequestFailure:
    return WireRequestFailure(failure.message, failure.kind.value, failure.param)


def failure_from_wire(w: WireRequestFailure) -> RequestFailure:
    return RequestFailure(w.message, FailureKind(w.kind), w.param)


def _pixels_by_identifier(items: Sequence[WireEncoderInput]) -> dict[str, ProcessedImage]:
    return {
        i.identifier: ProcessedImage(i.pixel_values, tuple(i.grid_thw), i.second_per_grid_t)
        for i in items
    }


# ------------------------------------------------------------ API <-> engine core


def request_to_wire(
    request_id: str,
    prompt: ProcessedPrompt,
    params: SamplingParams,
    *,
    arrival_time_s: float,
    cache_salt: str | None = None,
    eos_token_ids: tuple[int, ...] | None = None,
    held_identifiers: Container[str] = frozenset(),
) -> EngineCoreRequest:
    """Pixels (or a remote item's payload) go for every item that has them, once per
    identifier, except those the engine is known to hold (`held_identifiers`)."""
    encoder_inputs: dict[str, WireEncoderInput] = {}
    remote_items: dict[str, WireRemoteItem] = {}
    for f in prompt.mm_features:
        sent = f.identifier in encoder_inputs or f.identifier in remote_items
        if f.identifier in held_identifiers or sent:
            continue
        if isinstance(f.data, RemoteItem):
            remote_items[f.identifier] = remote_item_to_wire(f.identifier, f.data)
        elif (item := encoder_input_to_wire(f)) is not None:
            encoder_inputs[f.identifier] = item
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt.prompt_token_ids),
        mm_features=[feature_to_wire(f) for f in prompt.mm_features],
        encoder_inputs=list(encoder_inputs.values()),
        sampling_params=sampling_params_to_wire(params),
        mrope_positions=prompt.mrope_positions,
        mrope_position_delta=prompt.mrope_position_delta,
        eos_token_ids=eos_token_ids,
        cache_salt=cache_salt,
        arrival_time_s=arrival_time_s,
        remote_items=list(remote_items.values()),
    )


def request_from_wire(msg: EngineCoreRequest) -> AddRequest:
    """Raises WireError for a remote item that breaks RemoteItem's rules."""
    data: dict[str, ProcessedImage | RemoteItem] = {
        w.identifier: remote_item_from_wire(w) for w in msg.remote_items
    }
    data.update(_pixels_by_identifier(msg.encoder_inputs))
    prompt = ProcessedPrompt(
        prompt_token_ids=msg.prompt_token_ids,
        mm_features=[feature_from_wire(f, data.get(f.identifier)) for f in msg.mm_features],
        mrope_positions=msg.mrope_positions,
        mrope_position_delta=msg.mrope_position_delta,
    )
    params = sampling_params_from_wire(msg.sampling_params)
    return AddRequest(
        msg.request_id, prompt, params, msg.cache_salt, msg.eos_token_ids, msg.arrival_time_s
    )


def update_to_wire(update: RequestUpdate) -> EngineCoreOutput:
    status = update.finish_status
    finish_reason = FINISH_REASONS[status] if status is not None else None
    return EngineCoreOutput(
        request_id=update.request_id,
        new_token_ids=update.new_token_ids,
        finish_reason=finish_reason,
        stop_reason=update.stop_reason,
        error=failure_to_wire(update.error) if update.error is not None else None,
        num_cached_tokens=update.num_cached_tokens,
        first_scheduled_time_s=update.first_scheduled_time_s,
        logprobs=logprobs_to_wire(update.logprobs),
    )


def update_from_wire(out: EngineCoreOutput) -> RequestUpdate:
    status = _STATUS_BY_REASON[out.finish_reason] if out.finish_reason is not None else None
    return RequestUpdate(
        request_id=out.request_id,
        new_token_ids=out.new_token_ids,
        finish_status=status,
        stop_reason=out.stop_reason,
        error=failure_from_wire(out.error) if out.error is not None else None,
        num_cached_tokens=out.num_cached_tokens,
        first_scheduled_time_s=out.first_scheduled_time_s,
        logprobs=logprobs_from_wire(out.logprobs),
    )


def stats_to_wire(
    s: SchedulerStats,
    counters: Mapping[str, int] = MappingProxyType({}),
    gauges: Mapping[str, float] = MappingProxyType({}),
    modality_counters: Mapping[str, Mapping[str, int]] = MappingProxyType({}),
    labelled_counters: Mapping[str, Mapping[str, float]] = MappingProxyType({}),
) -> EngineStats:
    fields = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
    by_modality = {name: dict(counts) for name, counts in modality_counters.items()}
    by_label = {name: dict(counts) for name, counts in labelled_counters.items()}
    return EngineStats(
        **fields,
        counters=dict(counters),
        gauges=dict(gauges),
        modality_counters=by_modality,
        labelled_counters=by_label,
    )


def stats_from_wire(w: EngineStats) -> SchedulerStats:
    names = [f.name for f in dataclasses.fields(SchedulerStats)]
    return SchedulerStats(**{name: getattr(w, name) for name in names})


def apply_stats(w: EngineStats, metrics: EngineMetrics) -> None:
    """Mirror the engine process's stats into the API process's metrics (what it exports)."""
    record_scheduler_stats(metrics, w)
    for name, value in w.counters.items():
        metrics.set_counter(name, value)
    for name, gauge in w.gauges.items():
        metrics.set_gauge(name, gauge)
    for name, counts in w.modality_counters.items():
        for modality, value in counts.items():
            metrics.set_modality_counter(name, modality, value)
    for name, by_label in w.labelled_counters.items():
        for label, amount in by_label.items():
            metrics.set_labelled_counter(name, label, amount)


# ------------------------------------------------------------ scheduler <-> executor


def payload_to_wire(p: RunnerPayloadLike) -> WireRunnerPayload:
    return WireRunnerPayload(
        sampling_params_to_wire(p.sampling_params),
        p.mrope_positions,
        p.mrope_position_delta,
        tuple(p.eos_token_ids),
    )


def scheduler_output_to_wire(
    so: SchedulerOutput,
    features_of: Callable[[str], Sequence[MultiModalFeature]],
    grammar_output: GrammarOutput | None = None,
) -> WireSchedulerOutput:
    """`features_of(request_id)` gives a scheduled request's items (the scheduler's Request);
    `grammar_output` rides in the same message, as the executor's other input of the step.

    Each item scheduled for encoding sends its pixels once; an item without pixels is left
    out, and the executor fails its request as the in-process runner does.
    """
    encoder_inputs: dict[str, WireEncoderInput] = {}
    for request_id, item_idxs in so.scheduled_encoder_inputs.items():
        features = features_of(request_id)
        for i in item_idxs:
            f = features[i]
            if f.identifier not in encoder_inputs and (item := encoder_input_to_wire(f)):
                encoder_inputs[f.identifier] = item
    return WireSchedulerOutput(
        scheduled_new_reqs=[
            WireNewRequestData(
                r.request_id,
                r.token_ids,
                [feature_to_wire(f) for f in r.mm_features],
                r.block_ids,
                r.num_computed_tokens,
                payload_to_wire(r.payload),  # type: ignore[arg-type]
            )
            for r in so.scheduled_new_reqs
        ],
        scheduled_cached_reqs=[
            WireCachedRequestData(r.request_id, r.new_block_ids, r.num_computed_tokens)
            for r in so.scheduled_cached_reqs
        ],
        num_scheduled_tokens=so.num_scheduled_tokens,
        total_num_scheduled_tokens=so.total_num_scheduled_tokens,
        scheduled_encoder_inputs=so.scheduled_encoder_inputs,
        encoder_inputs=list(encoder_inputs.values()),
        free_encoder_identifiers=so.free_encoder_identifiers,
        finished_req_ids=so.finished_req_ids,
        preempted_req_ids=so.preempted_req_ids,
        grammar_bitmask=None
        if (g := grammar_output) is None
        else WireGrammarBitmask(list(g.request_ids), g.bitmask),
        remote_encoder_inputs=[
            WireRemoteEncoderInput(
                request_id, feature_to_wire(f), remote_item_to_wire(f.identifier, f.data)
            )
            for request_id, features in so.remote_encoder_inputs.items()
            for f in features
            if isinstance(f.data, RemoteItem)
        ],
    )


def scheduler_output_from_wire(
    msg: WireSchedulerOutput, make_payload: Callable[[WireRunnerPayload], object]
) -> StepInputs:
    """`make_payload` builds the runner's payload from the wire one."""
    pixels = _pixels_by_identifier(msg.encoder_inputs)
    new_reqs = [
        NewRequestData(
            r.request_id,
            r.token_ids,
            [feature_from_wire(f, pixels.get(f.identifier)) for f in r.mm_features],
            r.block_ids,
            r.num_computed_tokens,
            make_payload(r.payload),
        )
        for r in msg.scheduled_new_reqs
    ]
    so = SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=[
            CachedRequestData(r.request_id, r.new_block_ids, r.num_computed_tokens)
            for r in msg.scheduled_cached_reqs
        ],
        num_scheduled_tokens=msg.num_scheduled_tokens,
        total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
        scheduled_encoder_inputs=msg.scheduled_encoder_inputs,
        free_encoder_identifiers=msg.free_encoder_identifiers,
        finished_req_ids=msg.finished_req_ids,
        preempted_req_ids=msg.preempted_req_ids,
        remote_encoder_inputs=_remote_inputs_from_wire(msg.remote_encoder_inputs),
    )
    grammar = msg.grammar_bitmask
    grammar_output = (
        None if grammar is None else GrammarOutput(tuple(grammar.request_ids), grammar.bitmask)
    )
    return StepInputs(so, pixels, grammar_output)


def _remote_inputs_from_wire(
    items: Sequence[WireRemoteEncoderInput],
) -> dict[str, list[MultiModalFeature]]:
    by_request: dict[str, list[MultiModalFeature]] = {}
    for w in items:
        feature = feature_from_wire(w.feature, None)
        feature = dataclasses.replace(feature, data=remote_item_from_wire(w.item))
        by_request.setdefault(w.request_id, []).append(feature)
    return by_request


def runner_output_to_wire(o: ModelRunnerOutput) -> WireModelRunnerOutput:
    errors = {rid: failure_to_wire(e) for rid, e in o.errors.items()}
    logprobs = {
        rid: WireLogprobs(lp.token_ids, lp.logprobs, lp.ranks) for rid, lp in o.logprobs.items()
    }
    failed = {i: failure_to_wire(e) for i, e in o.encoder_failed.items()}
    return WireModelRunnerOutput(
        o.sampled_token_ids, errors, logprobs, list(o.encoder_arrived), failed
    )


def runner_output_from_wire(w: WireModelRunnerOutput) -> ModelRunnerOutput:
    errors = {rid: failure_from_wire(e) for rid, e in w.errors.items()}
    logprobs = {
        rid: Logprobs(lp.token_ids, lp.logprobs, lp.ranks) for rid, lp in w.logprobs.items()
    }
    failed = {i: failure_from_wire(e) for i, e in w.encoder_failed.items()}
    return ModelRunnerOutput(w.sampled_token_ids, errors, logprobs, w.encoder_arrived, failed)
