"""Messages between the scheduler and an executor in another process: one step and its answer."""

from __future__ import annotations

import numpy as np

from mmserve.wire.common import (
    Identifier,
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
)


class WireRunnerPayload(WireStruct):
    """What the runner needs to sample and position one request (`RunnerPayload`)."""

    sampling_params: WireSamplingParams
    mrope_positions: np.ndarray  # [3, num_prompt_tokens] int64
    mrope_position_delta: int
    eos_token_ids: tuple[TokenId, ...]

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.mrope_positions.shape[1])

    def __post_init__(self) -> None:
        positions = self.mrope_positions
        if positions.dtype != np.int64 or positions.ndim != 2 or positions.shape[0] != 3:
            raise WireError(
                f"runner payload: mrope_positions is {positions.dtype} {positions.shape}, "
                "expected int64 (3, num_prompt_tokens)"
            )


class WireNewRequestData(WireStruct):
    """A request the runner has no state for (first scheduled or resumed after preemption).

    `token_ids` is prompt + every token generated so far; `num_computed_tokens` is where this
    step starts. Items carry no pixels: those come in the step's `encoder_inputs`.
    """

    request_id: RequestId
    token_ids: list[TokenId]
    mm_features: list[WireMMFeature]
    block_ids: list[NonNegInt]
    num_computed_tokens: NonNegInt
    payload: WireRunnerPayload

    def __post_init__(self) -> None:
        owner = f"new request {self.request_id}"
        num_prompt = self.payload.num_prompt_tokens
        if not num_prompt <= len(self.token_ids) or self.num_computed_tokens > len(self.token_ids):
            raise WireError(
                f"{owner}: {len(self.token_ids)} token ids for {num_prompt} prompt tokens and "
                f"{self.num_computed_tokens} computed tokens; it needs at least both"
            )
        check_features(self.mm_features, num_prompt, owner)


class WireCachedRequestData(WireStruct):
    """A request the runner already holds: blocks appended this step and where the step starts."""

    request_id: RequestId
    new_block_ids: list[NonNegInt]
    num_computed_tokens: NonNegInt


class WireGrammarBitmask(WireStruct):
    """The allowed next tokens of the step's structured requests (`GrammarBitmask`).

    bitmask: [len(request_ids), ceil(vocab / 32)] int32, row i for request_ids[i].
    """

    request_ids: list[RequestId]
    bitmask: np.ndarray

    def __post_init__(self) -> None:
        shape = self.bitmask.shape
        if self.bitmask.dtype != np.int32 or len(shape) != 2 or shape[0] != len(self.request_ids):
            raise WireError(
                f"grammar bitmask is {self.bitmask.dtype} {shape}, expected int32 "
                f"[{len(self.request_ids)}, num_words]"
            )
        if len(set(self.request_ids)) != len(self.request_ids):
            raise WireError("grammar bitmask: a request id appears twice")


class WireRemoteEncoderInput(WireStruct):
    """A remote item a request sends to the encoder source this step: the item (placeholder,
    identity, grid) and its `RemoteItem`."""

    request_id: RequestId
    feature: WireMMFeature
    item: WireRemoteItem

    def __post_init__(self) -> None:
        if self.item.identifier != self.feature.identifier:
            raise WireError(
                f"remote item {self.item.identifier[:16]} sent for feature "
                f"{self.feature.identifier[:16]}"
            )
        if tuple(self.item.grid_thw) != tuple(self.feature.grid_thw):
            raise WireError(
                f"remote item {self.feature.identifier[:16]}: grid {tuple(self.item.grid_thw)} "
                f"but its feature says {tuple(self.feature.grid_thw)}"
            )


class WireSchedulerOutput(WireStruct):
    """One engine step as diffs against what the runner holds (see `SchedulerOutput`).

    `scheduled_encoder_inputs` names, per request, the indices of its items to encode this
    step; `encoder_inputs` carries their pixels, one entry per identifier. Pixels travel only
    on the step that encodes them: the sending side keeps what it needs to send them again
    (after a preemption or an encoder-cache eviction). `remote_encoder_inputs`: the items sent
    to the encoder source this step, whole (their requests may schedule no token).
    """

    scheduled_new_reqs: list[WireNewRequestData]
    scheduled_cached_reqs: list[WireCachedRequestData]
    num_scheduled_tokens: dict[RequestId, NonNegInt]
    total_num_scheduled_tokens: NonNegInt
    scheduled_encoder_inputs: dict[RequestId, list[NonNegInt]]
    encoder_inputs: list[WireEncoderInput]
    free_encoder_identifiers: list[Identifier]
    finished_req_ids: frozenset[RequestId]
    preempted_req_ids: frozenset[RequestId]
    grammar_bitmask: WireGrammarBitmask | None = None
    remote_encoder_inputs: list[WireRemoteEncoderInput] = []

    def __post_init__(self) -> None:
        total = sum(self.num_scheduled_tokens.values())
        if total != self.total_num_scheduled_tokens:
            raise WireError(
                f"scheduler output: total_num_scheduled_tokens is "
                f"{self.total_num_scheduled_tokens} but num_scheduled_tokens sums to {total}"
            )
        identifiers = {item.identifier for item in self.encoder_inputs}
        if len(identifiers) != len(self.encoder_inputs):
            raise WireError("scheduler output: an identifier appears twice in encoder_inputs")
        remote = {item.feature.identifier for item in self.remote_encoder_inputs}
        if len(remote) != len(self.remote_encoder_inputs) or remote & identifiers:
            raise WireError(
                "scheduler output: an identifier appears twice in remote_encoder_inputs, or "
                "also in encoder_inputs"
            )


class WireModelRunnerOutput(WireStruct):
    """The runner's answer: sampled token ids per request, the requests that failed, the
    sampled tokens' logprobs of requests that asked (one row per sampled token), and the
    remote items that arrived or failed (by identifier)."""

    sampled_token_ids: dict[RequestId, list[TokenId]]
    errors: dict[RequestId, WireRequestFailure] = {}
    logprobs: dict[RequestId, WireLogprobs] = {}
    encoder_arrived: list[Identifier] = []
    encoder_failed: dict[Identifier, WireRequestFailure] = {}

    def __post_init__(self) -> None:
        for request_id, logprobs in self.logprobs.items():
            num_tokens = len(self.sampled_token_ids.get(request_id, ()))
            if logprobs.ranks.shape[0] != num_tokens:
                raise WireError(
                    f"runner output: logprobs of request {request_id} cover "
                    f"{logprobs.ranks.shape[0]} tokens but it sampled {num_tokens}"
                )
