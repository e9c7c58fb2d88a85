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


def merge_completion(
    earlier: CompletionOutput, later: CompletionOutput, kind: OutputKind
) -> CompletionOutput:
    """`later` extended by what `earlier` (the same sequence's update just before it) added.

    Takes ownership of `later` (updated in place); the counts, finish and cumulative logprob
    are `later`'s, which come after `earlier`'s.
    """
    later.delta_text = earlier.delta_text + later.delta_text
    later.delta_token_ids = (earlier.delta_token_ids or []) + (later.delta_token_ids or [])
    if kind is OutputKind.DELTA:
        later.text = earlier.text + later.text
        later.token_ids = earlier.token_ids + later.token_ids
        if earlier.logprobs is not None or later.logprobs is not None:
            later.logprobs = (earlier.logprobs or []) + (later.logprobs or [])
    return later


def merge_update(earlier: RequestOutput, later: RequestOutput, kind: OutputKind) -> RequestOutput:
    """One update that says what two consecutive updates of one request said, `earlier`'s
    first: how a stream whose reader fell behind catches up in one step (vLLM's output
    collector does the same). Takes ownership of `later` (updated in place).

    Each sequence's `delta_*` parts are joined in order (and, for DELTA, its text, token ids
    and logprobs); a CUMULATIVE update's text already holds everything so far. A DELTA update
    holds only the sequences it changed, so one only `earlier` changed is kept, and the prompt
    logprobs a DELTA stream carries on its first update only are carried over.
    """
    by_index = {c.index: c for c in earlier.outputs}
    for c in later.outputs:
        before = by_index.get(c.index)
        by_index[c.index] = c if before is None else merge_completion(before, c, kind)
    later.outputs = [by_index[i] for i in sorted(by_index)]
    if later.prompt_logprobs is None:
        later.prompt_logprobs = earlier.prompt_logprobs
    return later
