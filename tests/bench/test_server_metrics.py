"""Prometheus parsing and before/after diffs of mmserve's counters."""

from __future__ import annotations

import pytest

from mmserve.bench.server_metrics import diff_snapshots, parse_metrics

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
