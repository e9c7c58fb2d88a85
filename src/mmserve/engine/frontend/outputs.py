"""What the engine returns for a request: cumulative text and token ids, and how it finished."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mmserve.errors import FailureKind


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability (vLLM's `Logprob`): `rank` 1 is the most likely token."""

    logprob: float
    rank: int
    decoded_token: str


# One generated token's entry: {token_id: Logprob} for the sampled token and the top K.
TokenLogprobs = dict[int, Logprob]


class OutputKind(enum.Enum):
    """What each update of a request carries (vLLM's RequestOutputKind).

    CUMULATIVE: every update, with the whole text and token ids so far (the offline default).
    DELTA: every update, with only what it added in `text`/`token_ids` (streaming: no update
    copies what came before, so a long answer costs linear, not quadratic, work).
    FINAL_ONLY: one update, the last, cumulative (a non-streaming answer).
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class CompletionOutput:
    """One generated sequence: `text`/`token_ids` cumulative (or, for `OutputKind.DELTA`, this
    update's part, the same as `delta_*`), `delta_*` what this update added, `num_tokens` the
    count generated so far in every kind.

    `logprobs` (when the request asked for them) has one entry per token of `token_ids`, and
    `cumulative_logprob` sums the sampled tokens' logprobs so far; both None otherwise.

    finish_reason is None while running, else "stop" (EOS, stop token or stop string),
    "length" (max_tokens or max_model_len), "abort" (client gone or aborted) or "error"
    (the request failed inside the engine; `error` on the RequestOutput says why).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] | None = None
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """One update of one request: `outputs` holds its n sequences (index 0..n-1; for
    `OutputKind.DELTA`, only those this update changed). A request that failed (finish_reason
    "error") carries why in `error`, whose fault in `error_kind` (REQUEST: the client's,
    answered 400 naming `error_param`; INTERNAL: the server's, answered 500) and nothing else
    fails with it (a failing sample fails its whole request)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    error_kind: FailureKind | None = None
    error_param: str | None = None
    # when the request asked: one entry per prompt token, None for the first (vLLM's shape);
    # a DELTA stream carries it on the first output only
    prompt_logprobs: list[TokenLogprobs | None] | None = None
