"""Engine metrics: one object the engine owns and hands to whoever exports it (no globals)."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

# Counters (monotonic) and gauges the engine keeps; names map 1:1 onto the Prometheus names
# `mmserve_<name>` (counters get `_total` appended by the exporter).
COUNTER_NAMES = (
    "processor_cache_queries",
    "processor_cache_hits",
    "encoder_cache_queries",
    "encoder_cache_hits",
    "encoder_items_encoded",
    "encoder_forward_calls",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "embedding_transfer_bytes",
    "prompt_tokens",
    "generation_tokens",
    "requests_finished",
    "requests_failed",
)
GAUGE_NAMES = (
    "kv_blocks_free",
    "kv_blocks_total",
    "encoder_cache_used_slots",
    "encoder_cache_resident_slots",
    "encoder_cache_total_slots",
    "num_requests_running",
    "num_requests_waiting",
)
TTFT_BUCKETS_S = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0, 2.5)


@dataclass
class Histogram:
    """Cumulative-bucket histogram in seconds, exported as a Prometheus histogram."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # one per bucket, plus +Inf
    total: float = 0.0
    num: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value_s: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value_s)] += 1
        self.total += value_s
        self.num += 1


@dataclass(frozen=True)
class MetricsSnapshot:
    counters: dict[str, int]
    gauges: dict[str, float]
    ttft: Histogram
    itl: Histogram


class EngineMetrics:
    """Thread-safe counters, gauges and latency histograms of one engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._gauges: dict[str, float] = dict.fromkeys(GAUGE_NAMES, 0.0)
        self._ttft = Histogram(TTFT_BUCKETS_S)
        self._itl = Histogram(ITL_BUCKETS_S)

    def inc(self, name: str, amount: int = 1) -> None:
        if name not in self._counters:
            raise KeyError(f"unknown counter {name!r}")
        with self._lock:
            self._counters[name] += amount

    def set_counter(self, name: str, value: int) -> None:
        """Mirror a counter kept elsewhere (a cache's own stats); it never goes down."""
        if name not in self._counters:
            raise KeyError(f"unknown counter {name!r}")
        with self._lock:
            self._counters[name] = max(self._counters[name], value)

    def set_gauge(self, name: str, value: float) -> None:
        if name not in self._gauges:
            raise KeyError(f"unknown gauge {name!r}")
        with self._lock:
            self._gauges[name] = value

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self._ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self._itl.observe(seconds)

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            return MetricsSnapshot(
                counters=dict(self._counters),
                gauges=dict(self._gauges),
                ttft=_copy(self._ttft),
                itl=_copy(self._itl),
            )


def _copy(h: Histogram) -> Histogram:
    return Histogram(h.buckets, list(h.counts), h.total, h.num)


# SchedulerStats field -> (kind, metric name): the one table both the engine and the API
# process's mirror of a remote engine's stats read.
SCHEDULER_METRICS = (
    ("num_running", "gauge", "num_requests_running"),
    ("num_waiting", "gauge", "num_requests_waiting"),
    ("num_free_kv_blocks", "gauge", "kv_blocks_free"),
    ("encoder_cache_used_slots", "gauge", "encoder_cache_used_slots"),
    ("encoder_cache_resident_slots", "gauge", "encoder_cache_resident_slots"),
    ("prefix_cache_queries", "counter", "prefix_cache_queries"),
    ("prefix_cache_hits", "counter", "prefix_cache_hits"),
    ("encoder_cache_queries", "counter", "encoder_cache_queries"),
    ("encoder_cache_hits", "counter", "encoder_cache_hits"),
)


def record_scheduler_stats(metrics: EngineMetrics, stats: object) -> None:
    """Set the gauges and counters of SCHEDULER_METRICS from a SchedulerStats (or its wire twin)."""
    for field_name, kind, metric in SCHEDULER_METRICS:
        value = getattr(stats, field_name)
        if kind == "gauge":
            metrics.set_gauge(metric, value)
        else:
            metrics.set_counter(metric, value)


# What the engine core counts itself (beyond SCHEDULER_METRICS): an engine process sends these
# with its stats, and the API process mirrors them. Everything else (tokens, requests, latency,
# the processor cache) is counted where the outputs are made.
CORE_COUNTERS = ("encoder_items_encoded", "encoder_forward_calls", "embedding_transfer_bytes")
CORE_GAUGES = ("kv_blocks_total", "encoder_cache_total_slots")
