"""Client-side statistics of a run: throughput, latency percentiles and errors by kind."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from mmserve.bench.client import RequestOutput


@dataclass(frozen=True)
class LatencyStats:
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    num_samples: int

    @classmethod
    def of(cls, values_s: list[float]) -> LatencyStats | None:
        if not values_s:
            return None
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0  # [num_samples]
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return cls(float(ms.mean()), float(p50), float(p90), float(p99), len(values_s))


@dataclass(frozen=True)
class BenchmarkMetrics:
    num_requests: int
    completed: int
    failed: int
    errors_by_kind: dict[str, int]
    duration_s: float
    total_input_tokens: int | None  # None when no response carried usage.prompt_tokens
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float | None  # (input + output) tokens / s
    ttft: LatencyStats | None
    tpot: LatencyStats | None
    itl: LatencyStats | None
    e2el: LatencyStats | None
    num_with_usage: int  # successful requests whose token counts came from the server's usage

    def to_json(self) -> dict:
        return asdict(self)


def compute_metrics(outputs: list[RequestOutput], duration_s: float) -> BenchmarkMetrics:
    ok = [o for o in outputs if o.is_success]
    errors = Counter(o.error_kind or "unknown" for o in outputs if not o.is_success)
    total_output = sum(o.output_tokens for o in ok)
    prompt_counts = [o.prompt_tokens for o in ok if o.prompt_tokens is not None]
    total_input = sum(prompt_counts) if prompt_counts else None
    duration_s = max(duration_s, 1e-9)
    return BenchmarkMetrics(
        num_requests=len(outputs),
        completed=len(ok),
        failed=len(outputs) - len(ok),
        errors_by_kind=dict(sorted(errors.items())),
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(
            None if total_input is None else (total_input + total_output) / duration_s
        ),
        ttft=LatencyStats.of([o.ttft_s for o in ok if o.ttft_s is not None]),
        tpot=LatencyStats.of([t for o in ok if (t := o.tpot_s) is not None]),
        itl=LatencyStats.of([gap for o in ok for gap in o.itl_s]),
        e2el=LatencyStats.of([o.latency_s for o in ok if o.latency_s is not None]),
        num_with_usage=sum(o.has_usage for o in ok),
    )


def throughput_over_time(
    outputs: list[RequestOutput], duration_s: float, num_bins: int = 50
) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens per second in equal time bins: (bin centres in s, tokens/s).

    Each content chunk carries output_tokens / num_chunks tokens, so the total matches the
    server's usage count even when one chunk holds several tokens.
    """
    times, weights = [], []
    for o in outputs:
        if o.is_success and o.chunk_at_s:
            times += o.chunk_at_s
            weights += [o.output_tokens / len(o.chunk_at_s)] * len(o.chunk_at_s)
    edges = np.linspace(0.0, max(duration_s, 1e-6), num_bins + 1)  # [num_bins + 1]
    tokens, _ = np.histogram(times, bins=edges, weights=weights or None)
    width_s = edges[1] - edges[0]
    return (edges[:-1] + edges[1:]) / 2, tokens / width_s
