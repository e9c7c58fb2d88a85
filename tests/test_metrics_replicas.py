"""EngineMetrics of a data-parallel engine: the replicas' total, and a replica that restarts."""

from __future__ import annotations

import pytest

from mmserve.metrics import EngineMetrics, SchedulerStats, record_scheduler_stats


def _stats(*, running: int, queries: int, hits: int, encoded: int) -> SchedulerStats:
    return SchedulerStats(
        num_running=running,
        num_waiting=0,
        num_free_kv_blocks=8,
        encoder_cache_used_slots=0,
        encoder_cache_used_bytes=0,
        encoder_cache_resident_slots=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        encoder_cache_queries=queries,
        encoder_cache_hits=hits,
        counters={"encoder_items_encoded": encoded},
        modality_counters={"encoder_items_encoded": {"image": encoded}},
        labelled_counters={"remote_encoder_items": {"http://e:1": encoded}},
    )


def test_the_snapshot_reads_the_core_series_as_the_replicas_total() -> None:
    replicas = [EngineMetrics(), EngineMetrics()]
    front = EngineMetrics(replicas=replicas)
    record_scheduler_stats(replicas[0], _stats(running=1, queries=4, hits=1, encoded=3))
    record_scheduler_stats(replicas[1], _stats(running=2, queries=6, hits=5, encoded=1))
    front.inc("prompt_tokens", 7)
    front.inc_labelled("dp_routed_requests", "affinity")
    total, parts = front.snapshots()
    assert [p.counters["encoder_cache_hits"] for p in parts] == [1, 5]
    assert (
        total.counters["encoder_cache_hits"] == 6 and total.counters["encoder_cache_queries"] == 10
    )
    assert total.gauges["num_requests_running"] == 3 and total.gauges["kv_blocks_free"] == 16
    assert total.counters["encoder_items_encoded"] == 4
    assert total.modality_counters["encoder_items_encoded"] == {"image": 4, "video": 0}
    assert total.labelled_counters["remote_encoder_items"] == {"http://e:1": 4}
    assert total.counters["prompt_tokens"] == 7  # the API process's own
    assert total.labelled_counters["dp_routed_requests"] == {"affinity": 1}
    assert front.snapshot() == total


def test_replicas_are_distinct_and_flat() -> None:
    one = EngineMetrics()
    with pytest.raises(ValueError, match="distinct"):
        EngineMetrics(replicas=[one, one])
    with pytest.raises(ValueError, match="without replicas of their own"):
        EngineMetrics(replicas=[EngineMetrics(replicas=[one])])
    front = EngineMetrics()
    with pytest.raises(ValueError, match="distinct"):
        front.replicas = [front]
    # given after construction (once the replicas have started), and kept by reference
    replicas = [EngineMetrics(), EngineMetrics()]
    front.replicas = replicas
    replicas[1] = EngineMetrics()
    replicas[1].set_gauge("num_requests_running", 4)
    assert front.snapshot().gauges["num_requests_running"] == 4


def test_a_restarted_source_adds_to_the_counts_so_far() -> None:
    """A replica's engine process dies and another starts counting from 0: its series (and so
    the engine's total) never go down, and its gauges read 0 while it is gone."""
    metrics = EngineMetrics()
    record_scheduler_stats(metrics, _stats(running=3, queries=10, hits=4, encoded=6))
    metrics.reset_source()
    snap = metrics.snapshot()
    assert snap.gauges["num_requests_running"] == 0
    assert snap.counters["encoder_cache_hits"] == 4  # kept
    record_scheduler_stats(metrics, _stats(running=1, queries=2, hits=1, encoded=1))
    snap = metrics.snapshot()
    assert snap.counters["encoder_cache_queries"] == 12 and snap.counters["encoder_cache_hits"] == 5
    assert snap.counters["encoder_items_encoded"] == 7
    assert snap.modality_counters["encoder_items_encoded"]["image"] == 7
    assert snap.labelled_counters["remote_encoder_items"] == {"http://e:1": 7}
    assert snap.gauges["num_requests_running"] == 1
    # without the reset, a restarted source's small counts would be lost under the old maximum
    plain = EngineMetrics()
    record_scheduler_stats(plain, _stats(running=3, queries=10, hits=4, encoded=6))
    record_scheduler_stats(plain, _stats(running=1, queries=2, hits=1, encoded=1))
    assert plain.snapshot().counters["encoder_cache_hits"] == 4
