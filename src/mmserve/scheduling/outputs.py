"""Messages across the scheduler boundary: the step sent to the runner, its answer, and what
one step did to one request (`RequestUpdate`, which also crosses to the API process)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
import numpy as np

from mmserve.errors import RequestFailure
from mmserve.metrics import SchedulerStats
from mmserve.multimodal import MultiModalFeature
from mmserve.scheduling.request import RequestStatus

# A vocabulary index: bounded (on decode) so that no id overflows the tensors it indexes.
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]

__all__ = [
    "CachedRequestData",
    "GrammarOutput",
    "Logprobs",
    "ModelRunnerOutput",
    "NewRequestData",
    "RequestUpdate",
    "SchedulerOutput",
    "SchedulerStats",  # defined beside the metric names it carries (mmserve.metrics)
]


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has no state for: first scheduled, or resumed after preemption.

    `token_ids` is prompt + every token generated so far (a resumed request re-prefills its
    outputs); `num_computed_tokens` is where this step starts (the prefix-cache hit length).
    """

    request_id: str
    token_ids: list[int]
    mm_features: list[MultiModalFeature]
    block_ids: list[int]
    num_computed_tokens: int
    payload: object


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds: blocks appended this step and where the step starts."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(frozen=True)
class GrammarOutput:
    """The allowed next tokens of the step's structured requests: the engine core computes it
    after scheduling and hands it to the executor's sampling beside the `SchedulerOutput`.

    Row i of `bitmask` belongs to `request_ids[i]`: bit j of word w allows token 32 * w + j.
    Requests not listed sample from their whole vocabulary.
    """

    request_ids: tuple[str, ...]
    bitmask: np.ndarray  # [len(request_ids), ceil(vocab / 32)] int32

    def __post_init__(self) -> None:
        shape = self.bitmask.shape
        if self.bitmask.dtype.str != "<i4" or len(shape) != 2 or shape[0] != len(self.request_ids):
            raise ValueError(
                f"grammar bitmask is {self.bitmask.dtype} {shape}, expected int32 "
                f"[{len(self.request_ids)}, num_words]"
            )
        if len(set(self.request_ids)) != len(self.request_ids):
            raise ValueError("grammar bitmask: a request id appears twice")


@dataclass(frozen=True)
class SchedulerOutput:
    """One engine step, as diffs against what the runner already has.

    The runner applies it in this order: drop `finished_req_ids` and `preempted_req_ids`, free
    `free_encoder_identifiers` from its encoder cache (cancelling those still in flight at its
    encoder source), take what the source has delivered, send every item of
    `remote_encoder_inputs` to the source, encode every item in `scheduled_encoder_inputs`
    (each identifier appears at most once per step, in one of the two), then run the language
    model on `num_scheduled_tokens[req]` tokens of each request starting at its
    `num_computed_tokens`. A request gets sampled tokens only when its step reaches the end
    of its known tokens.

    `remote_encoder_inputs` carries item specs, not item indexes: a request may send an item
    while it schedules no token (it stands at the item), so the runner may hold no state for
    it (the executor side holds its `RemoteItem` by identifier since the request was added).
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_encoder_inputs: dict[str, list[int]]
    free_encoder_identifiers: list[str]
    finished_req_ids: frozenset[str]
    preempted_req_ids: frozenset[str]
    # request id -> items sent to the encoder source this step (see above)
    remote_encoder_inputs: dict[str, list[MultiModalFeature]] = field(default_factory=dict)


class Logprobs(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Log-probabilities of a request's sampled tokens, one row per token (vLLM's layout).

    Column 0 is the sampled token, columns 1..K the K most likely tokens in rank order; the
    values are the log-softmax of the model's raw logits (before penalties or temperature).
    The arrays travel as raw frames (`wire.codec`); their shapes and dtypes are checked here.
    """

    token_ids: np.ndarray  # [num_tokens, 1 + K] int32
    logprobs: np.ndarray  # [num_tokens, 1 + K] float32
    ranks: np.ndarray  # [num_tokens] int32: the sampled token's rank (1 = most likely)

    def __post_init__(self) -> None:
        ids, values, ranks = self.token_ids, self.logprobs, self.ranks
        if ids.dtype != np.int32 or values.dtype != np.float32 or ranks.dtype != np.int32:
            raise ValueError(
                f"logprobs: dtypes {ids.dtype}, {values.dtype}, {ranks.dtype}; expected "
                "int32 token_ids, float32 logprobs, int32 ranks"
            )
        if ids.ndim != 2 or ids.shape[1] < 1 or values.shape != ids.shape:
            raise ValueError(
                f"logprobs: token_ids {ids.shape} and logprobs {values.shape} must be the same "
                "[num_tokens, 1 + K]"
            )
        if ranks.shape != (ids.shape[0],):
            raise ValueError(f"logprobs: ranks {ranks.shape}, expected ({ids.shape[0]},)")
        if ids.size and (int(ids.min()) < 0 or int(ranks.min()) < 1):
            raise ValueError("logprobs: token ids must be >= 0 and ranks >= 1")

    @property
    def num_tokens(self) -> int:
        return int(self.ranks.shape[0])

    def head(self, num_tokens: int) -> Logprobs:
        """The rows of the first `num_tokens` tokens (a stop may cut a step's tokens short)."""
        if num_tokens >= self.num_tokens:
            return self
        return Logprobs(
            self.token_ids[:num_tokens], self.logprobs[:num_tokens], self.ranks[:num_tokens]
        )


@dataclass(frozen=True)
class ModelRunnerOutput:
    """The runner's answer: sampled tokens per request, their logprobs for requests that asked,
    and requests that failed inside it (e.g. a placeholder/embedding count mismatch) with why
    and whose fault it is.

    `encoder_arrived` names the remote items whose embeddings are now in the runner's encoder
    cache; `encoder_failed` the remote items nobody could encode, with the failure every
    request holding one ends with.
    """

    sampled_token_ids: dict[str, list[int]]
    errors: dict[str, RequestFailure] = field(default_factory=dict)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    encoder_arrived: list[str] = field(default_factory=list)
    encoder_failed: dict[str, RequestFailure] = field(default_factory=dict)


class RequestUpdate(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What one step did to one request, for the engine's output processor (in this process,
    or in the API process: `wire.engine_core.EngineCoreOutputs` carries it as it is).

    `new_token_ids` is a delta, never the whole output. `finish_status` None: still running;
    `error` comes exactly with FINISHED_ERROR.
    """

    request_id: str
    new_token_ids: list[TokenId]
    finish_status: RequestStatus | None = None
    stop_reason: TokenId | None = None  # the stop token id that ended it, if one did
    error: RequestFailure | None = None
    num_cached_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0  # first schedule's prefix hit
    # When the core first scheduled it (`time.monotonic()`, one clock for both processes on
    # one host): on the request's first update only, None on every other (a preemption does
    # not move it).
    first_scheduled_time_s: float | None = None
    logprobs: Logprobs | None = None  # one row per new token, when the request asked

    def __post_init__(self) -> None:
        owner = f"update of request {self.request_id}"
        status = self.finish_status
        if status is not None and not status.is_finished:
            raise ValueError(f"{owner}: finish_status {status.value!r} is not a finished one")
        if (self.error is None) != (status is not RequestStatus.FINISHED_ERROR):
            raise ValueError(
                f"{owner}: finish_status {status} with error {self.error!r}; an error comes "
                "exactly with FINISHED_ERROR"
            )
        t = self.first_scheduled_time_s
        if t is not None and not (math.isfinite(t) and t >= 0.0):
            raise ValueError(
                f"{owner}: first_scheduled_time_s {t!r}; a time.monotonic() value is finite "
                "and >= 0"
            )
        if self.logprobs is not None and self.logprobs.num_tokens != len(self.new_token_ids):
            raise ValueError(
                f"{owner}: logprobs for {self.logprobs.num_tokens} tokens but "
                f"{len(self.new_token_ids)} new tokens"
            )

    @property
    def finished(self) -> bool:
        return self.finish_status is not None
