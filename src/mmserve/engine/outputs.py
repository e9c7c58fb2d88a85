"""What the engine returns for a request: cumulative text and token ids, and how it finished."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.errors import FailureKind


@dataclass
class CompletionOutput:
    """One generated sequence: `text`/`token_ids` cumulative, `delta_*` what this update added.

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


@dataclass
class RequestOutput:
    """One update of one request. A request that failed (finish_reason "error") carries why
    in `error`, whose fault in `error_kind` (REQUEST: the client's, answered 400 naming
    `error_param`; INTERNAL: the server's, answered 500) and nothing else fails with it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    error_kind: FailureKind | None = None
    error_param: str | None = None
