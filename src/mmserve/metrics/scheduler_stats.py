"""The engine core's stats as they cross to the API process, and how they are recorded."""

from __future__ import annotations

from typing import Annotated

import msgspec

from mmserve.metrics.engine_metrics import EngineMetrics
from mmserve.metrics.names import (
    COUNTER_NAMES,
    GAUGE_NAMES,
    LABELLED_COUNTERS,
    MODALITY_COUNTERS,
    SCHEDULER_METRICS,
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
