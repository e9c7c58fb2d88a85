"""EngineMetrics: one object the engine owns and hands to whoever exports it (no globals)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from mmserve.metrics.histogram import FinishedRequestStats, Histogram, token_buckets
from mmserve.metrics.names import (
    COUNTER_NAMES,
    DEFAULT_MAX_TOKEN_BUCKET,
    FINISHED_REASONS,
    GAUGE_NAMES,
    ITL_BUCKETS_S,
    LABEL_VALUES_FROM_START,
    LABELLED_COUNTERS,
    MODALITIES,
    MODALITY_COUNTERS,
    PHASE_HISTOGRAMS,
    REQUEST_LATENCY_BUCKETS_S,
    TOKEN_HISTOGRAMS,
    TTFT_BUCKETS_S,
)
from mmserve.metrics.snapshot import MetricsSnapshot, with_replicas_total


class EngineMetrics:
    """Thread-safe counters, gauges and histograms of one engine.

    `max_model_len` bounds the buckets of the per-request token histograms. A data-parallel
    engine gives its `replicas`' metrics (one EngineMetrics per engine-core process, each
    recording that replica's stats): this object then keeps the API process's series and its
    `snapshot` reads the engine-core series (CORE_SERIES) as the replicas' total.
    """

    def __init__(
        self,
        *,
        max_model_len: int = DEFAULT_MAX_TOKEN_BUCKET,
        replicas: Sequence[EngineMetrics] = (),
    ) -> None:
        self._replicas: Sequence[EngineMetrics] = ()
        self.replicas = replicas
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._gauges: dict[str, float] = dict.fromkeys(GAUGE_NAMES, 0.0)
        self._request_success = dict.fromkeys(FINISHED_REASONS, 0)
        self._modality_counters = {n: dict.fromkeys(MODALITIES, 0) for n in MODALITY_COUNTERS}
        self._labelled: dict[str, dict[str, float]] = {
            n: dict.fromkeys(LABEL_VALUES_FROM_START.get(n, ()), 0) for n in LABELLED_COUNTERS
        }
        # What mirrored values add to (see reset_source): counter -> base, and per modality and
        # label value keyed (name, key).
        self._base: dict[str, float] = {}
        self._keyed_base: dict[tuple[str, str], float] = {}
        token_bounds = tuple(float(b) for b in token_buckets(max_model_len))
        self._histograms = {
            "time_to_first_token_seconds": Histogram(TTFT_BUCKETS_S),
            "inter_token_latency_seconds": Histogram(ITL_BUCKETS_S),
            **{name: Histogram(REQUEST_LATENCY_BUCKETS_S) for name in PHASE_HISTOGRAMS},
            **{name: Histogram(token_bounds) for name in TOKEN_HISTOGRAMS},
        }

    @property
    def replicas(self) -> Sequence[EngineMetrics]:
        """The data-parallel replicas' metrics, as given (not copied): read at every snapshot,
        so an entry the engine replaces in place is read from then on."""
        return self._replicas

    @replicas.setter
    def replicas(self, replicas: Sequence[EngineMetrics]) -> None:
        ids = {id(r) for r in replicas}
        if len(ids) < len(replicas) or id(self) in ids or any(r.replicas for r in replicas):
            raise ValueError(
                "the replicas' metrics must be distinct, without replicas of their own"
            )
        self._replicas = replicas

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
            value += self._keyed_base.get((name, label), 0)
            by_label[label] = max(by_label.get(label, 0), value)

    def set_modality_counter(self, name: str, modality: str, value: int) -> None:
        """Mirror one modality's count of a MODALITY_COUNTERS counter; it never goes down."""
        if name not in self._modality_counters:
            raise KeyError(f"counter {name!r} is not kept per modality")
        with self._lock:
            by_modality = self._modality_counters[name]
            value += int(self._keyed_base.get((name, modality), 0))
            by_modality[modality] = max(by_modality.get(modality, 0), value)

    def set_counter(self, name: str, value: int) -> None:
        """Mirror a counter kept elsewhere (a cache's own stats); it never goes down."""
        if name not in self._counters:
            raise KeyError(f"unknown counter {name!r}")
        with self._lock:
            value += int(self._base.get(name, 0))
            self._counters[name] = max(self._counters[name], value)

    def set_gauge(self, name: str, value: float) -> None:
        if name not in self._gauges:
            raise KeyError(f"unknown gauge {name!r}")
        with self._lock:
            self._gauges[name] = value

    def reset_source(self) -> None:
        """The process whose counts these mirror (`set_*`) is gone: its gauges read 0 now, and
        a process that replaces it counts from 0 again, so what it reports is added to the
        counts so far (every counter stays monotonic: a restarted replica never looks like a
        counter reset, neither in its own series nor in the engine's total)."""
        with self._lock:
            self._base = {n: float(v) for n, v in self._counters.items()}
            self._keyed_base = {
                (name, key): float(v)
                for table in (self._modality_counters, self._labelled)
                for name, by_key in table.items()
                for key, v in by_key.items()
            }
            self._gauges = dict.fromkeys(self._gauges, 0.0)

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
        """Every series now; with replicas, the engine-core series are their total."""
        return self.snapshots()[0]

    def snapshots(self) -> tuple[MetricsSnapshot, list[MetricsSnapshot]]:
        """(the engine's snapshot, each replica's) from one read of each: the total is the sum
        of exactly these replicas' values. Without replicas the list is empty."""
        replicas = [r.snapshot() for r in self._replicas]
        own = self._own_snapshot()
        return (with_replicas_total(own, replicas) if replicas else own), replicas

    def _own_snapshot(self) -> MetricsSnapshot:
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
