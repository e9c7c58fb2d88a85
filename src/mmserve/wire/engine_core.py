"""Messages between the API process and the engine-core process, both directions."""

from __future__ import annotations

import numpy as np

from mmserve.config.resolved import ResolvedConfig
from mmserve.config.scheduler import SchedulerConfig
from mmserve.metrics import SchedulerStats
from mmserve.sampling_params import SamplingParams
from mmserve.scheduling.outputs import RequestUpdate
from mmserve.wire.common import (
    RequestId,
    TokenId,
    WireEncoderInput,
    WireError,
    WireMMFeature,
    WireRemoteItem,
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
    sampling_params: SamplingParams
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


class EngineCoreOutputs(WireStruct):
    """One step's updates, in scheduling order (`RequestUpdate`: each a delta; logprobs, when
    asked for, one row per new token); the core's stats ride along when they changed."""

    outputs: list[RequestUpdate]
    stats: SchedulerStats | None = None


class EngineCoreReady(WireStruct):
    """Sent once, when the engine core has loaded the model and can take requests.

    `config` is what the core resolved (device, dtype, KV blocks, budgets): the same
    `ResolvedConfig` the API process logs and serves, checked field by field on decode.
    `scheduler` is the core's scheduler config (its encoder cache's bytes follow from the dtype
    it resolved): the API process admits requests by it.
    """

    config: ResolvedConfig
    scheduler: SchedulerConfig


class EngineDead(WireStruct):
    """The engine core is stopping for good: no request can run until a restart."""

    reason: str
