"""One consistent read of an engine's metrics, and the total of a data-parallel engine's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mmserve.metrics.histogram import Histogram
from mmserve.metrics.names import CORE_SERIES, GAUGE_AGGREGATES


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


def with_replicas_total(
    front: MetricsSnapshot, replicas: Sequence[MetricsSnapshot]
) -> MetricsSnapshot:
    """`front` (the API process's series) with every engine-core series (CORE_SERIES) replaced
    by the replicas' total: counters summed (per modality, per label value), gauges summed but
    those of GAUGE_AGGREGATES. The KV-cache usage of the total is then the share of all the
    replicas' blocks in use, not a sum of ratios."""
    counters = dict(front.counters)
    gauges = dict(front.gauges)
    modality = {n: dict(m) for n, m in front.modality_counters.items()}
    labelled = {n: dict(c) for n, c in front.labelled_counters.items()}
    for name in CORE_SERIES:
        if name in counters:
            counters[name] = sum(r.counters[name] for r in replicas)
        if name in gauges:
            values = [r.gauges[name] for r in replicas]
            gauges[name] = max(values) if GAUGE_AGGREGATES.get(name) == "max" else sum(values)
        if name in modality:
            modality[name] = _sum_by_key([r.modality_counters[name] for r in replicas])
        if name in labelled:
            labelled[name] = _sum_by_key([r.labelled_counters[name] for r in replicas])
    return MetricsSnapshot(
        counters=counters,
        gauges=gauges,
        histograms=front.histograms,
        request_success=front.request_success,
        modality_counters=modality,
        labelled_counters=labelled,
    )


def _sum_by_key(parts: Sequence[dict]) -> dict:
    total: dict = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0) + value
    return total
