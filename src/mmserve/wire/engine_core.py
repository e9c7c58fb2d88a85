"""Messages between the API process and the engine-core process, both directions."""

from __future__ import annotations

import math

import numpy as np

from mmserve.config.scheduler import SchedulerConfig
from mmserve.metrics import COUNTER_NAMES, GAUGE_NAMES, LABELLED_COUNTERS, MODALITY_COUNTERS
from mmserve.wire.common import (
    FinishReason,
    NonNegFloat,
    NonNegInt,
    RequestId,
    TokenId,
    WireEncoderInput,
    WireError,
    WireLogprobs,
    WireMMFeature,
    WireRemoteItem,
    WireRequestFailure,
    WireSamplingParams,
    WireStruct,
    check_features,
    check_positions,
)

# ----------------------------------------------------------------------- API -> engine core


class EngineCoreRequest(WireStruct):
    """A processed prompt to add: token ids with expanded placeholders, items, positions.

    `encoder_inputs` holds the pixels of the items the engine may have to encode, and
    `remote_items` those the encoder pool encodes (a disaggregated server; payloads as raw
    frames); an item whose identifier the engine already holds may be left out of both.
    `mrope_positions` is None for a text-only prompt built without the processor (the engine
    derives them). `eos_token_ids` None means the model's own. `arrival_time_s` is the API
    process's `time.monotonic()`, the same clock as the engine's on one host.
    """

    request_id: RequestId
    prompt_token_ids: list[TokenId]
    mm_features: list[WireMMFeature]
    encoder_inputs: list[WireEncoderInput]
    sampling_params: WireSamplingParams
    mrope_positions: np.ndarray | None  # [3, num_prompt_tokens] int64
    mrope_position_delta: int
    eos_token_ids: tuple[TokenId, ...] | None
    cache_salt: str | None
    arrival_time_s: float
    remote_items: list[WireRemoteItem] = []

    def __post_init__(self) -> None:
        owner = f"request {self.request_id}"
        num_tokens = len(self.prompt_token_ids)
        if self.mrope_positions is not None:
            check_positions(self.mrope_positions, num_tokens, owner)
        check_features(self.mm_features, num_tokens, owner)
        grids = {f.identifier: f.grid_thw for f in self.mm_features}
        for item in [*self.encoder_inputs, *self.remote_items]:
            if grids.get(item.identifier) != item.grid_thw:
                raise WireError(
                    f"{owner}: encoder input {item.identifier[:16]} (grid_thw "
                    f"{tuple(item.grid_thw)}) matches none of the request's items"
                )
        modalities = {f.identifier: f.modality for f in self.mm_features}
        pixels = {item.identifier for item in self.encoder_inputs}
        for item in self.remote_items:
            if modalities[item.identifier] != "image" or item.identifier in pixels:
                raise WireError(
                    f"{owner}: remote item {item.identifier[:16]} is not an image item that "
                    "travels without pixels"
                )


class EngineCoreAbort(WireStruct):
    """Stop these requests (client gone or cancelled); unknown ids are ignored."""

    request_ids: list[RequestId]


class EngineCoreShutdown(WireStruct):
    """Finish now: the API process has drained (or given up on) what it wanted to finish."""


# ----------------------------------------------------------------------- engine core -> API


class EngineCoreOutput(WireStruct):
    """What one step did to one request. `new_token_ids` is a delta, never the whole output
    (and `logprobs`, when the request asked for them, has one row per new token).

    `finish_reason` None: still running. `stop_reason` is the stop token id that ended it, if
    one did. `num_cached_tokens` is the prefix-cache hit of the request's first schedule (the
    value of usage.prompt_tokens_details.cached_tokens), repeated on every output.
    `first_scheduled_time_s` is when the core first scheduled the request (`time.monotonic()`,
    the API process's clock too: one host), on the request's first output only (queue time).
    """

    request_id: RequestId
    new_token_ids: list[TokenId]
    finish_reason: FinishReason | None = None
    stop_reason: TokenId | None = None
    error: WireRequestFailure | None = None
    num_cached_tokens: NonNegInt = 0
    first_scheduled_time_s: float | None = None
    logprobs: WireLogprobs | None = None  # one row per new token, when the request asked

    def __post_init__(self) -> None:
        t = self.first_scheduled_time_s
        if t is not None and not (math.isfinite(t) and t >= 0.0):
            raise WireError(
                f"output of request {self.request_id}: first_scheduled_time_s {t!r}; "
                "a time.monotonic() value is finite and >= 0"
            )
        if (self.error is None) != (self.finish_reason != "error"):
            raise WireError(
                f"output of request {self.request_id}: finish_reason {self.finish_reason!r} "
                f"with error {self.error!r}; an error comes exactly with finish_reason 'error'"
            )
        if self.logprobs is not None and self.logprobs.ranks.shape[0] != len(self.new_token_ids):
            raise WireError(
                f"output of request {self.request_id}: logprobs for "
                f"{self.logprobs.ranks.shape[0]} tokens but {len(self.new_token_ids)} new tokens"
            )


class EngineStats(WireStruct):
    """The engine process's gauges (now) and counters (since start); prefix counters in tokens.

    The first ten fields and the last two mirror `SchedulerStats`; `counters` and `gauges`
    carry the other engine-side metrics by their `mmserve.metrics` names (e.g.
    encoder_items_encoded, kv_blocks_total); `modality_counters` the per-modality counts of
    MODALITY_COUNTERS (name -> modality -> count).
    """

    num_running: NonNegInt
    num_waiting: NonNegInt
    num_free_kv_blocks: NonNegInt
    encoder_cache_used_slots: NonNegInt
    encoder_cache_used_bytes: NonNegInt
    encoder_cache_resident_slots: NonNegInt
    prefix_cache_queries: NonNegInt
    prefix_cache_hits: NonNegInt
    encoder_cache_queries: NonNegInt
    encoder_cache_hits: NonNegInt
    counters: dict[str, NonNegInt] = {}
    gauges: dict[str, float] = {}
    modality_counters: dict[str, dict[str, NonNegInt]] = {}
    # LABELLED_COUNTERS name -> label value -> count (fractional for a seconds sum)
    labelled_counters: dict[str, dict[str, NonNegFloat]] = {}
    encoder_inflight_items: NonNegInt = 0
    encoder_inflight_bytes: NonNegInt = 0
    encoder_pool_bytes: NonNegInt = 0

    def __post_init__(self) -> None:
        unknown = (
            sorted(set(self.counters) - set(COUNTER_NAMES))
            + sorted(set(self.gauges) - set(GAUGE_NAMES))
            + sorted(set(self.modality_counters) - set(MODALITY_COUNTERS))
            + sorted(set(self.labelled_counters) - set(LABELLED_COUNTERS))
        )
        if unknown:
            raise WireError(f"engine stats name unknown metrics {unknown}; see mmserve.metrics")


class EngineCoreOutputs(WireStruct):
    """One step's outputs, in scheduling order; the step's stats ride along when they changed."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats | None = None


class EngineCoreReady(WireStruct):
    """Sent once, when the engine core has loaded the model and can take requests.

    `config` is what the core resolved (`config.resolved.ResolvedConfig`: device, dtype, KV
    blocks, budgets), by field name; the API process logs it. A list is a tuple of ints there
    (the decode CUDA graph sizes). `scheduler` is the core's scheduler config (its encoder
    cache's bytes follow from the dtype it resolved): the API process admits requests by it.
    """

    config: dict[str, str | int | bool | list[int]]
    scheduler: SchedulerConfig


class EngineDead(WireStruct):
    """The engine core is stopping for good: no request can run until a restart."""

    reason: str
