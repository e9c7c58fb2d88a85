"""Prometheus parsing and before/after diffs of mmserve's counters."""

from __future__ import annotations

import pytest

from mmserve.api.prometheus import build_registry, render
from mmserve.bench.metrics import compute_metrics
from mmserve.bench.report import format_table
from mmserve.bench.server_metrics import diff_snapshots, parse_metrics
from mmserve.metrics import EngineMetrics

BEFORE = """\
# HELP mmserve_encoder_cache_queries_total Items looked up.
# TYPE mmserve_encoder_cache_queries_total counter
mmserve_encoder_cache_queries_total{model="a"} 10.0
mmserve_encoder_cache_queries_total{model="b"} 10.0
mmserve_encoder_cache_queries_created{model="a"} 1.7e9
# TYPE mmserve_encoder_cache_hits counter
mmserve_encoder_cache_hits_total{model="a"} 5.0
mmserve_encoder_cache_hits_total{model="b"} 0.0
mmserve_encoder_items_encoded_total 15
# TYPE mmserve_prefix_cache_queries_total untyped
mmserve_prefix_cache_queries_total 100
mmserve_prefix_cache_hits_total 0
"""
AFTER = (
    BEFORE.replace('"a"} 10.0', '"a"} 30.0')
    .replace('"a"} 5.0', '"a"} 20.0')
    .replace("encoded_total 15", "encoded_total 20")
    .replace("queries_total 100", "queries_total 300")
    .replace("hits_total 0\n", "hits_total 50\n")
)


def test_diff_sums_labels_and_accepts_both_counter_spellings() -> None:
    server = diff_snapshots(parse_metrics(BEFORE), parse_metrics(AFTER))
    enc = server["cache_tiers"]["encoder_cache"]
    assert (enc["queries"], enc["hits"], enc["hit_rate"]) == (20, 15, 0.75)
    assert enc["hit_rate_before"] == 0.25 and enc["hit_rate_after"] == 0.5
    prefix = server["cache_tiers"]["prefix_cache"]
    assert (prefix["queries"], prefix["hits"], prefix["hit_rate"]) == (200, 50, 0.25)
    assert server["cache_tiers"]["processor_cache"]["hit_rate"] is None  # not exposed
    assert server["encoder_items_encoded"] == 5
    assert server["encoder_forward_calls"] is None


def test_not_prometheus_is_rejected() -> None:
    with pytest.raises(ValueError):
        parse_metrics("<html><body>Not Found</body></html>")
    assert not parse_metrics("other_counter_total 3\n").has_mmserve_counters()


def test_the_two_transfer_directions_are_kept_apart() -> None:
    text = """\
# TYPE mmserve_embedding_transfer_bytes counter
mmserve_embedding_transfer_bytes_total{model_name="m",direction="sent"} 100
mmserve_embedding_transfer_bytes_total{model_name="m",direction="received"} 7000
"""
    later = text.replace(" 100", " 150").replace(" 7000", " 9000")
    server = diff_snapshots(parse_metrics(text), parse_metrics(later))
    assert server["embedding_bytes_sent"] == 50
    assert server["embedding_bytes_received"] == 2000


def _data_parallel_exposition(hits: list[int], queries: list[int], routed: int) -> str:
    """What a two-replica server's /metrics says (its exporter's own rendering)."""
    replicas = [EngineMetrics(), EngineMetrics()]
    for metrics, h, q in zip(replicas, hits, queries, strict=True):
        metrics.set_counter("encoder_cache_hits", h)
        metrics.set_counter("encoder_cache_queries", q)
        metrics.inc("encoder_items_encoded", q - h, modality="image")
    front = EngineMetrics(replicas=replicas)
    front.inc_labelled("dp_routed_requests", "affinity", routed)
    return render(build_registry(front, "m")).decode()


def test_a_data_parallel_server_is_diffed_per_replica_and_in_total() -> None:
    before = parse_metrics(_data_parallel_exposition([1, 0], [2, 2], routed=4))
    after = parse_metrics(_data_parallel_exposition([11, 5], [20, 12], routed=30))
    assert after.replicas == ("0", "1")
    server = diff_snapshots(before, after)
    total = server["cache_tiers"]["encoder_cache"]
    assert (total["queries"], total["hits"]) == (28, 15)  # the total, not total + replicas
    assert server["encoder_items_encoded"] == 13
    one, two = server["replicas"]["0"], server["replicas"]["1"]
    assert one["cache_tiers"]["encoder_cache"]["hit_rate"] == 10 / 18
    assert two["cache_tiers"]["encoder_cache"]["hit_rate"] == 5 / 10
    assert (one["encoder_items_encoded"], two["encoder_items_encoded"]) == (8, 5)
    assert server["routed_requests"] == {"affinity": 26, "load": 0}
    table = format_table(compute_metrics([], duration_s=1.0), server)
    assert "replica 0 encoder hit rate:" in table and "55.6% (10/18)" in table
    assert "replica 1 encoder hit rate:" in table and "50.0% (5/10)" in table
    assert "encoder hit rate (hits/queries):" in table and "53.6% (15/28)" in table
    assert "requests routed by affinity:" in table


def test_a_single_engine_server_has_no_replica_section() -> None:
    metrics = EngineMetrics()
    text = render(build_registry(metrics, "m")).decode()
    server = diff_snapshots(parse_metrics(text), parse_metrics(text))
    assert "replicas" not in server and server["cache_tiers"]["encoder_cache"]["queries"] == 0
    assert "replica" not in format_table(compute_metrics([], duration_s=1.0), server)
