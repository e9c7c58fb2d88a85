"""Exports an engine's EngineMetrics in Prometheus text format through a per-app registry."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from mmserve.metrics import EngineMetrics, Histogram

_HISTOGRAMS = {
    "ttft": ("mmserve_time_to_first_token_seconds", "Time from arrival to the first token."),
    "itl": ("mmserve_inter_token_latency_seconds", "Time between consecutive output tokens."),
}


class EngineMetricsCollector(Collector):
    """Reads one snapshot per scrape, so the exported values are mutually consistent."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snapshot = self._metrics.snapshot()
        for name, value in snapshot.counters.items():
            # CounterMetricFamily appends `_total` to the sample name.
            yield CounterMetricFamily(f"mmserve_{name}", _doc(name), value=value)
        for name, value in snapshot.gauges.items():
            yield GaugeMetricFamily(f"mmserve_{name}", _doc(name), value=value)
        for key, histogram in (("ttft", snapshot.ttft), ("itl", snapshot.itl)):
            metric_name, doc = _HISTOGRAMS[key]
            yield HistogramMetricFamily(
                metric_name,
                doc,
                buckets=_cumulative_buckets(histogram),
                sum_value=histogram.total,
            )


def _cumulative_buckets(histogram: Histogram) -> list[tuple[str, float]]:
    # EngineMetrics counts each observation in one bucket; Prometheus buckets are cumulative.
    buckets = []
    running = 0
    for bound, count in zip(histogram.buckets, histogram.counts, strict=False):
        running += count
        buckets.append((repr(float(bound)), float(running)))
    buckets.append(("+Inf", float(histogram.num)))
    return buckets


def _doc(name: str) -> str:
    return name.replace("_", " ").capitalize() + "."


def build_registry(metrics: EngineMetrics) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineMetricsCollector(metrics))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
