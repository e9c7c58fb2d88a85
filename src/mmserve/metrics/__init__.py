"""Engine metrics: what an engine counts and how its parts reach the exporter (no globals).

By concern: `names` (every series, its labels and buckets, which ones the engine core counts),
`histogram`, `snapshot` (one consistent read; a data-parallel engine's total), `engine_metrics`
(`EngineMetrics`), `scheduler_stats` (the core's stats on the wire and their mirror).
docs/metrics.md lists every series.
"""

from mmserve.metrics.engine_metrics import EngineMetrics
from mmserve.metrics.histogram import FinishedRequestStats, Histogram, token_buckets
from mmserve.metrics.names import (
    CORE_COUNTERS,
    CORE_GAUGES,
    CORE_SERIES,
    COUNTER_NAMES,
    DEFAULT_MAX_TOKEN_BUCKET,
    DP_ROUTED_REASONS,
    FINISHED_REASONS,
    FRONT_LABELLED_COUNTERS,
    GAUGE_AGGREGATES,
    GAUGE_NAMES,
    HISTOGRAM_NAMES,
    ITL_BUCKETS_S,
    LABEL_VALUES_FROM_START,
    LABELLED_COUNTERS,
    MODALITIES,
    MODALITY_COUNTERS,
    PHASE_HISTOGRAMS,
    REQUEST_LATENCY_BUCKETS_S,
    SCHEDULER_METRICS,
    TOKEN_HISTOGRAMS,
    TTFT_BUCKETS_S,
)
from mmserve.metrics.scheduler_stats import SchedulerStats, record_scheduler_stats
from mmserve.metrics.snapshot import MetricsSnapshot, with_replicas_total

__all__ = [
    "CORE_COUNTERS",
    "CORE_GAUGES",
    "CORE_SERIES",
    "COUNTER_NAMES",
    "DEFAULT_MAX_TOKEN_BUCKET",
    "DP_ROUTED_REASONS",
    "FINISHED_REASONS",
    "FRONT_LABELLED_COUNTERS",
    "GAUGE_AGGREGATES",
    "GAUGE_NAMES",
    "HISTOGRAM_NAMES",
    "ITL_BUCKETS_S",
    "LABEL_VALUES_FROM_START",
    "LABELLED_COUNTERS",
    "MODALITIES",
    "MODALITY_COUNTERS",
    "PHASE_HISTOGRAMS",
    "REQUEST_LATENCY_BUCKETS_S",
    "SCHEDULER_METRICS",
    "TOKEN_HISTOGRAMS",
    "TTFT_BUCKETS_S",
    "EngineMetrics",
    "FinishedRequestStats",
    "Histogram",
    "MetricsSnapshot",
    "SchedulerStats",
    "record_scheduler_stats",
    "token_buckets",
    "with_replicas_total",
]
