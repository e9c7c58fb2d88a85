"""The scheduler's view of one request: tokens, multimodal items, progress and stop rules."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.multimodal import MultiModalFeature
from mmserve.updates import RequestStatus


@dataclass(slots=True)
class Request:
    """Mutable per-request state owned by the scheduler.

    `payload` is opaque to the scheduler: the engine attaches what the runner needs (sampling
    params, M-RoPE positions) and it travels unread in `NewRequestData`. `eos_token_ids=None`
    means "use the scheduler's EOS ids". `num_computed_tokens` counts tokens whose KV is
    written (or scheduled to be written by the step in flight).
    """

    request_id: str
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None
    cache_salt: str | None = None
    # NOTE: prompt logprobs need the logits of every prompt position, which a prefix-cache hit
    # would skip: such a request computes its whole prompt (its blocks are still cached for
    # others), as in vLLM.
    skip_reading_prefix_cache: bool = False
    payload: object = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_hashes: list[str] = field(default_factory=list)
    stop_reason: int | None = None
    num_preemptions: int = 0
    # The prefix-cache hit of its first schedule, in tokens (usage's cached_tokens); None
    # until then. A recompute after preemption does not change it.
    num_cached_tokens: int | None = None
    # When it was first scheduled (the scheduler's clock), for the queue-time metric; None
    # until then. Reported on its first update, then `is_schedule_time_reported`.
    first_scheduled_time_s: float | None = None
    is_schedule_time_reported: bool = False
    # identifiers of items its prefill has passed: their data waits, bounded, on the executor
    # side (`ItemDataHolder`) in case a preemption needs them encoded again
    passed_items: set[str] = field(default_factory=set)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_ids_in(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]


def check_stop(request: Request, max_model_len: int, default_eos: tuple[int, ...]) -> bool:
    """Apply the stop rules after one token was appended; sets status/stop_reason on a stop.

    EOS and stop tokens only count once `min_tokens` outputs exist; length limits always do.
    Stop *strings* are the detokenizer's business (it calls `finish_requests`).
    """
    last_token = request.output_token_ids[-1]
    if request.num_output_tokens >= request.min_tokens:
        eos_ids = default_eos if request.eos_token_ids is None else request.eos_token_ids
        if not request.ignore_eos and last_token in eos_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token
            return True
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False
