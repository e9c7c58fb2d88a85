"""What one engine step did to one request: its status, sampled tokens and logprobs; the same
values in the engine process and, through `wire.engine_core.EngineCoreOutputs`, the API's."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated

import msgspec
import numpy as np

from mmserve.errors import RequestFailure

# A vocabulary index: bounded (on decode) so that no id overflows the tensors it indexes.
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self.value.startswith("finished")


# The OpenAI finish_reason of each finished status (what outputs and the wire carry).
FINISH_REASONS: Mapping[RequestStatus, str] = MappingProxyType(
    {
        RequestStatus.FINISHED_STOPPED: "stop",
        RequestStatus.FINISHED_LENGTH: "length",
        RequestStatus.FINISHED_ABORTED: "abort",
        RequestStatus.FINISHED_ERROR: "error",
    }
)


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
    # one row per prompt token but the first (its logits predict the next prompt token), on
    # the update that carries the first sampled token, when the request asked
    prompt_logprobs: Logprobs | None = None

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
