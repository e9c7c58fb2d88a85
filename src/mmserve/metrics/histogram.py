"""A histogram in Prometheus's shape, and what one finished request adds to the histograms."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from mmserve.metrics.names import FINISHED_REASONS, PHASE_HISTOGRAMS


def token_buckets(max_num_tokens: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... while <= max_num_tokens (vLLM's 1-2-5 series)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_num_tokens:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


@dataclass
class Histogram:
    """A histogram in the unit of its name (seconds or tokens), exported as Prometheus's."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # one per bucket, plus +Inf
    total: float = 0.0
    num: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.num += 1

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.total, self.num)


@dataclass(frozen=True)
class FinishedRequestStats:
    """One finished request, as the per-request histograms see it.

    A phase the request never reached is None and is not observed: a request aborted while
    waiting has no queue time, one that ended before its first token has no prefill time.
    """

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency_s: float
    queue_time_s: float | None
    prefill_time_s: float | None
    decode_time_s: float | None
    inference_time_s: float | None

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISHED_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} is not in {FINISHED_REASONS}")

    def phases_s(self) -> dict[str, float | None]:
        """PHASE_HISTOGRAMS name -> value, in seconds."""
        values = (
            self.e2e_latency_s,
            self.queue_time_s,
            self.prefill_time_s,
            self.decode_time_s,
            self.inference_time_s,
        )
        return dict(zip(PHASE_HISTOGRAMS, values, strict=True))
