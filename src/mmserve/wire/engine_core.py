"""Messages between the API process and the engine-core process, both directions."""

from __future__ import annotations

import numpy as np

from mmserve.config.resolved import ResolvedConfig
from mmserve.config.scheduler import SchedulerConfig
from mmserve.metrics import SchedulerStats
from mmserve.multimodal import EncoderInput, MultiModalFeature, ProcessedPrompt, RemoteItem
from mmserve.sampling_params import SamplingParams
from mmserve.updates import RequestUpdate
from mmserve.wire.common import (
    Identifier,
    RequestId,
    TokenId,
    WireError,
    WireStruct,
    check_features,
    check_positions,
)

# ----------------------------------------------------------------------- API -> engine core


class EngineCoreRequest(WireStruct):
    """A processed prompt to add: token ids with expanded placeholders, item specs, positions.

    `encoder_inputs` holds the pixels of the items the engine may have to encode, and
    `remote_items` those the encoder pool encodes (a disaggregated server; payloads as raw
    frames), each once per identifier; an item the engine already holds (named by UUID and
    cached) is in neither. `mrope_positions` is None for a text-only prompt built without the
    processor (the engine derives them). `eos_token_ids` None means the model's own.
    `arrival_time_s` is the API process's `time.monotonic()`, the same clock as the engine's
    on one host.
    """

    request_id: RequestId
    prompt_token_ids: list[TokenId]
    mm_features: list[MultiModalFeature]
    encoder_inputs: dict[Identifier, EncoderInput]
    sampling_params: SamplingParams
    mrope_positions: np.ndarray | None  # [3, num_prompt_tokens] int64
    mrope_position_delta: int
    eos_token_ids: tuple[TokenId, ...] | None
    cache_salt: str | None
    arrival_time_s: float
    remote_items: dict[Identifier, RemoteItem] = {}

    @classmethod
    def of(
        cls,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        *,
        arrival_time_s: float,
        cache_salt: str | None = None,
    ) -> EngineCoreRequest:
        """The envelope of an admitted prompt: its specs, and each item's data once."""
        data = prompt.mm_data
        return cls(
            request_id=request_id,
            prompt_token_ids=list(prompt.prompt_token_ids),
            mm_features=list(prompt.mm_features),
            encoder_inputs={i: d for i, d in data.items() if isinstance(d, EncoderInput)},
            sampling_params=params,
            mrope_positions=prompt.mrope_positions,
            mrope_position_delta=prompt.mrope_position_delta,
            eos_token_ids=None,
            cache_salt=cache_salt,
            arrival_time_s=arrival_time_s,
            remote_items={i: d for i, d in data.items() if isinstance(d, RemoteItem)},
        )

    def prompt(self) -> ProcessedPrompt:
        """The prompt as the engine core adds it (`EngineCore.add_request`)."""
        return ProcessedPrompt(
            prompt_token_ids=self.prompt_token_ids,
            mm_features=self.mm_features,
            mrope_positions=self.mrope_positions,
            mrope_position_delta=self.mrope_position_delta,
            mm_data={**self.remote_items, **self.encoder_inputs},
        )

    def __post_init__(self) -> None:
        owner = f"request {self.request_id}"
        num_tokens = len(self.prompt_token_ids)
        if self.mrope_positions is not None:
            check_positions(self.mrope_positions, num_tokens, owner)
        check_features(self.mm_features, num_tokens, owner)
        specs = {f.identifier: f for f in self.mm_features}
        for identifier, item in [*self.encoder_inputs.items(), *self.remote_items.items()]:
            spec = specs.get(identifier)
            if spec is None or tuple(spec.grid_thw) != tuple(item.grid_thw):
                raise WireError(
                    f"{owner}: encoder input {identifier[:16]} (grid_thw "
                    f"{tuple(item.grid_thw)}) matches none of the request's items"
                )
            remote = isinstance(item, RemoteItem)
            if remote != spec.is_remote or (remote and spec.modality != "image"):
                raise WireError(
                    f"{owner}: remote item {identifier[:16]} is not an image item that "
                    "travels without pixels"
                    if remote
                    else f"{owner}: item {identifier[:16]} travels as pixels, its spec says remote"
                )
        both = self.encoder_inputs.keys() & self.remote_items.keys()
        if both:
            raise WireError(
                f"{owner}: remote item {min(both)[:16]} is not an image item that travels "
                "without pixels"
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
