"""Engine metrics: one object the engine owns and hands to whoever exports it (no globals)."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated

import msgspec

# Counters (monotonic) and gauges the engine keeps; names map 1:1 onto the Prometheus names
# `mmserve_<name>` (counters get `_total` appended by the exporter). docs/metrics.md lists
# every series with its unit and its vLLM counterpart.
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
    "num_preemptions",
    "remote_encoder_retries",
    "remote_encoder_fallbacks",
)
GAUGE_NAMES = (
    "kv_blocks_free",
    "kv_blocks_total",
    "encoder_cache_used_slots",
    "encoder_cache_resident_slots",
    "encoder_cache_total_slots",
    "num_requests_running",
    "num_requests_waiting",
    "encoder_pool_bytes",
    "remote_encoder_healthy",
    "remote_encoder_items_in_flight",
)
# Counters also kept per item modality: their samples carry a `modality` label (one per entry
# of MODALITIES, present from the start; the unlabelled total is their sum).
MODALITY_COUNTERS = ("encoder_items_encoded", "encoder_forward_calls")
MODALITIES = ("image", "video")
# Counters kept per value of one label (counter name -> label name), the label values appearing
# as they are first counted (an encoder's URL, a drop reason). A name also in COUNTER_NAMES
# keeps its unlabelled total there; the others are exported only by label. Values may be
# fractional (a latency sum in seconds).
LABELLED_COUNTERS = MappingProxyType(
    {
        "embedding_transfer_bytes": "direction",  # "sent" (item payloads) | "received" (embeddings)
        "remote_encoder_items": "encoder",
        "remote_encoder_latency_seconds": "encoder",
        "remote_encoder_dropped_messages": "reason",
        "dp_routed_requests": "reason",  # "affinity" | "load": how a replica was chosen
    }
)
# Label values present from the start (at 0), so their series exist before anything is counted.
LABEL_VALUES_FROM_START = MappingProxyType({"embedding_transfer_bytes": ("sent", "received")})
# The finish reasons a finished request is counted under (request_success{finished_reason}):
# the OpenAI finish_reason values of scheduling.request.FINISH_REASONS.
FINISHED_REASONS = ("stop", "length", "abort", "error")

# Every bound vLLM uses for the same series (so a query on any `le` works), plus mmserve's
# finer low ones.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# vLLM's buckets for its per-request phase histograms, so that dashboards bucket alike.
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# Per-request token-count histograms bucket 1, 2, 5, 10, 20, 50, ... up to this many tokens
# when the engine's max_model_len is not given.
DEFAULT_MAX_TOKEN_BUCKET = 1_000_000

# Histograms that time a finished request's phases (observed once per finished request).
PHASE_HISTOGRAMS = (
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
)
TOKEN_HISTOGRAMS = ("request_prompt_tokens", "request_generation_tokens")
HISTOGRAM_NAMES = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    *PHASE_HISTOGRAMS,
    *TOKEN_HISTOGRAMS,
)


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


@dataclass(frozen=True)
class MetricsSnapshot:
    counters: dict[str, int]
    gauges: dict[str, float]
    histograms: dict[str, Histogram]  # by HISTOGRAM_NAMES
    request_success: dict[str, int]  # finished requests by FINISHED_REASONS
    # MODALITY_COUNTERS name -> modality -> count; `counters` has their totals
    modality_counters: dict[str, dict[str, int]] = field(default_factory=dict)
    # LABELLED_COUNTERS name -> label value -> count
    labelled_counters: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def ttft(self) -> Histogram:
        return self.histograms["time_to_first_token_seconds"]

    @property
    def itl(self) -> Histogram:
        return self.histograms["inter_token_latency_seconds"]

    @property
    def kv_cache_usage(self) -> float:
        """Fraction (0..1) of KV blocks held by requests; cached free blocks count as free."""
        total = self.gauges["kv_blocks_total"]
        return 1.0 - self.gauges["kv_blocks_free"] / total if total else 0.0


class EngineMetrics:
    """Thread-safe counters, gauges and histograms of one engine.

    `max_model_len` bounds the buckets of the per-request token histograms.
    """

    def __init__(self, *, max_model_len: int = DEFAULT_MAX_TOKEN_BUCKET) -> None:
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._gauges: dict[str, float] = dict.fromkeys(GAUGE_NAMES, 0.0)
        self._request_success = dict.fromkeys(FINISHED_REASONS, 0)
        self._modality_counters = {n: dict.fromkeys(MODALITIES, 0) for n in MODALITY_COUNTERS}
        self._labelled: dict[str, dict[str, float]] = {
            n: dict.fromkeys(LABEL_VALUES_FROM_START.get(n, ()), 0) for n in LABELLED_COUNTERS
        }
        token_bounds = tuple(float(b) for b in token_buckets(max_model_len))
        self._histograms = {
            "time_to_first_token_seconds": Histogram(TTFT_BUCKETS_S),
            "inter_token_latency_seconds": Histogram(ITL_BUCKETS_S),
            **{name: Histogram(REQUEST_LATENCY_BUCKETS_S) for name in PHASE_HISTOGRAMS},
            **{name: Histogram(token_bounds) for name in TOKEN_HISTOGRAMS},
        }

    def inc(self, name: str, amount: int = 1, *, modality: str | None = None) -> None:
        """`modality`: also count it under that modality (MODALITY_COUNTERS only)."""
        if name not in self._counters:
            raise KeyError(f"unknown counter {name!r}")
        if modality is not None and name not in self._modality_counters:
            raise KeyError(f"counter {name!r} is not kept per modality")
        with self._lock:
            self._counters[name] += amount
            if modality is not None:
                by_modality = self._modality_counters[name]
                by_modality[modality] = by_modality.get(modality, 0) + amount

    def inc_labelled(self, name: str, label: str, amount: float = 1) -> None:
        """Count `amount` under one label value of a LABELLED_COUNTERS counter (and its
        unlabelled total when it has one)."""
        if name not in self._labelled:
            raise KeyError(f"counter {name!r} is not kept by label")
        with self._lock:
            by_label = self._labelled[name]
            by_label[label] = by_label.get(label, 0) + amount
            if name in self._counters:
                self._counters[name] += int(amount)

    def set_labelled_counter(self, name: str, label: str, value: float) -> None:
        """Mirror one label value of a LABELLED_COUNTERS counter; it never goes down."""
        if name not in self._labelled:
            raise KeyError(f"counter {name!r} is not kept by label")
        with self._lock:
            by_label = self._labelled[name]
            by_label[label] = max(by_label.get(label, 0), value)

    def set_modality_counter(self, name: str, modality: str, value: int) -> None:
        """Mirror one modality's count of a MODALITY_COUNTERS counter; it never goes down."""
        if name not in self._modality_counters:
            raise KeyError(f"counter {name!r} is not kept per modality")
        with self._lock:
            by_modality = self._modality_counters[name]
            by_modality[modality] = max(by_modality.get(modality, 0), value)

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
        self._observe("time_to_first_token_seconds", seconds)

    def observe_itl(self, seconds: float) -> None:
        self._observe("inter_token_latency_seconds", seconds)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        """Count one finished request and observe its phases and token counts."""
        with self._lock:
            self._request_success[stats.finish_reason] += 1
            for name, value in stats.phases_s().items():
                if value is not None:
                    self._histograms[name].observe(value)
            self._histograms["request_prompt_tokens"].observe(stats.num_prompt_tokens)
            self._histograms["request_generation_tokens"].observe(stats.num_generation_tokens)

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            return MetricsSnapshot(
                counters=dict(self._counters),
                gauges=dict(self._gauges),
                histograms={name: h.copy() for name, h in self._histograms.items()},
                request_success=dict(self._request_success),
                modality_counters={n: dict(m) for n, m in self._modality_counters.items()},
                labelled_counters={n: dict(c) for n, c in self._labelled.items()},
            )

    def _observe(self, name: str, value: float) -> None:
        with self._lock:
            self._histograms[name].observe(value)


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
    ("encoder_pool_bytes", "gauge", "encoder_pool_bytes"),
    ("encoder_inflight_items", "gauge", "remote_encoder_items_in_flight"),
)


NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class SchedulerStats(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Gauges (now) and counters (since start) of the engine core; prefix counters in tokens.

    The scheduler fills the named fields (`Scheduler.make_stats`). An engine process adds what
    its core counts beyond them (`counters` and `gauges` by their names here: CORE_COUNTERS,
    CORE_GAUGES; `modality_counters` name -> modality -> count; `labelled_counters` name ->
    label value -> amount) and sends the whole value to the API process, which records it.
    """

    num_running: NonNegInt
    num_waiting: NonNegInt
    num_free_kv_blocks: NonNegInt
    encoder_cache_used_slots: NonNegInt  # referenced by unfinished requests
    encoder_cache_used_bytes: NonNegInt
    encoder_cache_resident_slots: NonNegInt  # referenced + freeable entries still resident
    prefix_cache_queries: NonNegInt
    prefix_cache_hits: NonNegInt
    encoder_cache_queries: NonNegInt
    encoder_cache_hits: NonNegInt
    encoder_inflight_items: NonNegInt = 0  # remote items sent to the encoder source, not arrived
    encoder_inflight_bytes: NonNegInt = 0  # ... and the cache bytes reserved for them
    encoder_pool_bytes: NonNegInt = 0  # cache bytes of arrived remote embeddings
    counters: dict[str, NonNegInt] = {}
    gauges: dict[str, float] = {}
    modality_counters: dict[str, dict[str, NonNegInt]] = {}
    labelled_counters: dict[str, dict[str, Annotated[float, msgspec.Meta(ge=0.0)]]] = {}

    def __post_init__(self) -> None:
        unknown = (
            sorted(set(self.counters) - set(COUNTER_NAMES))
            + sorted(set(self.gauges) - set(GAUGE_NAMES))
            + sorted(set(self.modality_counters) - set(MODALITY_COUNTERS))
            + sorted(set(self.labelled_counters) - set(LABELLED_COUNTERS))
        )
        if unknown:
            raise ValueError(f"scheduler stats name unknown metrics {unknown}; see mmserve.metrics")


def record_scheduler_stats(metrics: EngineMetrics, stats: SchedulerStats) -> None:
    """Set the gauges and counters of SCHEDULER_METRICS, then every named metric `stats`
    carries (those of an engine process, mirrored in the API process)."""
    for field_name, kind, metric in SCHEDULER_METRICS:
        value = getattr(stats, field_name)
        if kind == "gauge":
            metrics.set_gauge(metric, value)
        else:
            metrics.set_counter(metric, value)
    for name, count in stats.counters.items():
        metrics.set_counter(name, count)
    for name, gauge in stats.gauges.items():
        metrics.set_gauge(name, gauge)
    for name, counts in stats.modality_counters.items():
        for modality, count in counts.items():
            metrics.set_modality_counter(name, modality, count)
    for name, by_label in stats.labelled_counters.items():
        for label, amount in by_label.items():
            metrics.set_labelled_counter(name, label, amount)


# What the engine core counts itself (beyond SCHEDULER_METRICS): an engine process sends these
# with its stats, and the API process mirrors them. Everything else (tokens, requests, latency,
# the processor cache) is counted where the outputs are made.
CORE_COUNTERS = (
    "encoder_items_encoded",
    "encoder_forward_calls",
    "embedding_transfer_bytes",
    "num_preemptions",
    "remote_encoder_retries",
    "remote_encoder_fallbacks",
)
CORE_GAUGES = (
    "kv_blocks_total",
    "encoder_cache_total_slots",
    "remote_encoder_healthy",
)
