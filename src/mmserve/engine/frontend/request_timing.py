"""When one request reached each phase, and the phase durations the metrics observe at its end."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.metrics import FinishedRequestStats


@dataclass(slots=True)
class RequestTimes:
    """`time.monotonic()` seconds; the engine core's clock is the same one (one host).

    ```
    arrival ── queue ──▶ first scheduled ── prefill ──▶ first token ── decode ──▶ last token ─▶ end
                         |<─────────────────── inference ──────────────────────▶|
    |<──────────────────────────────────── e2e ──────────────────────────────────────────────▶|
    ```

    `first_scheduled_s` is the first time the engine core scheduled the request: a preempted
    request that waits again does not move it (its second wait counts as inference time).
    """

    arrival_s: float
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None

    def on_scheduled(self, scheduled_s: float) -> None:
        if self.first_scheduled_s is None:
            self.first_scheduled_s = scheduled_s

    def on_tokens(self, now_s: float) -> None:
        if self.first_token_s is None:
            self.first_token_s = now_s
        self.last_token_s = now_s

    def finished(
        self, now_s: float, finish_reason: str, num_prompt_tokens: int, num_generation_tokens: int
    ) -> FinishedRequestStats:
        scheduled, first, last = self.first_scheduled_s, self.first_token_s, self.last_token_s
        return FinishedRequestStats(
            finish_reason=finish_reason,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=num_generation_tokens,
            e2e_latency_s=now_s - self.arrival_s,
            queue_time_s=None if scheduled is None else scheduled - self.arrival_s,
            prefill_time_s=None if scheduled is None or first is None else first - scheduled,
            decode_time_s=None if first is None or last is None else last - first,
            inference_time_s=None if scheduled is None or last is None else last - scheduled,
        )
