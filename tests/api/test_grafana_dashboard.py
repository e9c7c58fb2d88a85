"""docs/grafana/mmserve.json reads only series mmserve exports: every metric name in every
PromQL expression (panels and variables) is a sample name of a `/metrics` exposition, suffix
included (`_total`, `_bucket`, `_sum`, `_count`), and every label it matches or groups by is
one those samples carry (or one Prometheus adds at scrape: instance, job)."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmserve.api.prometheus import build_registry, render
from mmserve.disaggregation.encoder_metrics import EncoderMetrics
from mmserve.engine.frontend.request_timing import RequestTimes
from mmserve.metrics import EngineMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "mmserve.json"
# A metric name, then its label matchers if any: mmserve_x_total{a="b", c=~"d"}
METRIC_REF = re.compile(r"\b(mmserve_[A-Za-z0-9_]+)\b\s*(\{[^}]*\})?")
MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
SCRAPE_LABELS = {"instance", "job"}  # added by Prometheus to every scraped series


def _samples(text: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] |= set(sample.labels)
    return out


def _engine_exposition() -> str:
    """What `serve`'s /metrics exports once it has served: requests finished, and a remote
    encoder pool that answered (its per-encoder series appear only then)."""
    metrics = EngineMetrics(max_model_len=64)
    times = RequestTimes(arrival_s=0.0)
    times.on_scheduled(0.25)
    times.on_tokens(0.5)
    times.on_tokens(0.9)
    metrics.record_finished(times.finished(1.0, "length", 20, 2))
    metrics.inc_labelled("remote_encoder_items", "http://10.0.0.2:9000")
    metrics.inc_labelled("remote_encoder_latency_seconds", "http://10.0.0.2:9000", 0.05)
    metrics.inc_labelled("remote_encoder_dropped_messages", "stale")
    return render(build_registry(metrics, "Qwen/Qwen2-VL-2B-Instruct")).decode()


def _data_parallel_exposition() -> str:
    """What a two-replica `serve` exports: its core series per replica beside their totals,
    and the routing counter."""
    replicas = [EngineMetrics(max_model_len=64), EngineMetrics(max_model_len=64)]
    for metrics in replicas:
        metrics.inc_labelled("remote_encoder_items", "http://10.0.0.2:9000")
        metrics.inc_labelled("remote_encoder_latency_seconds", "http://10.0.0.2:9000", 0.05)
        metrics.inc_labelled("remote_encoder_dropped_messages", "stale")
    front = EngineMetrics(max_model_len=64, replicas=replicas)
    return render(build_registry(front, "Qwen/Qwen2-VL-2B-Instruct")).decode()


def _encoder_server_exposition() -> str:
    """What an `mmserve encode` server's /metrics exports, its labelled counters counted once."""
    metrics = EncoderMetrics()
    metrics.add_gauges(
        queued_patches=lambda: 0, queued_items=lambda: 0, cache_bytes=lambda: 0,
        plan_store_bytes=lambda: 0,
    )  # fmt: skip
    metrics.item_errors.labels(code="internal").inc()
    metrics.malformed.labels(reason="bad_header").inc()
    metrics.plan_requests.labels(outcome="ok").inc()
    return metrics.render().decode()


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    samples = _samples(_engine_exposition())
    for text in (_data_parallel_exposition(), _encoder_server_exposition()):
        for name, labels in _samples(text).items():
            samples[name] = samples.get(name, set()) | labels
    return samples


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # rows, collapsed or not


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    out = []
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r}", target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            out.append(
                (f"variable ${var['name']}", query if isinstance(query, str) else query["query"])
            )
    return out


def problems(dashboard: dict, exported: dict[str, set[str]]) -> list[str]:
    """Every metric name that no exposition has, and every label no sample of it carries."""
    found = []
    for where, expr in expressions(dashboard):
        refs = METRIC_REF.findall(expr)
        if not refs:
            found.append(f"{where}: no mmserve series in {expr!r}")
        labels_here = set(SCRAPE_LABELS | {"le"})
        for name, matchers in refs:
            if name not in exported:
                found.append(f"{where}: {name} is not exported")
                continue
            labels_here |= exported[name]
            for label, op, value in MATCHER.findall(matchers):
                # `label=""` selects series without the label: fine on any series
                absent_ok = op == "=" and value == ""
                if label not in exported[name] | SCRAPE_LABELS and not absent_ok:
                    found.append(f"{where}: {name} has no label {label!r}")
        for group in GROUPING.findall(expr):
            for label in filter(None, (g.strip() for g in group.split(","))):
                if label not in labels_here:
                    found.append(f"{where}: grouping by {label!r}, which no series here has")
    return found


def test_every_series_and_label_the_dashboard_reads_is_exported(exported) -> None:
    assert problems(_dashboard(), exported) == []


def test_a_panel_naming_a_series_that_does_not_exist_fails(exported) -> None:
    dashboard = _dashboard()
    panel = next(p for p in _panels(dashboard["panels"]) if p.get("targets"))
    panel["targets"].append({"expr": "sum(rate(mmserve_prompt_tokens[5m]))", "refId": "Z"})
    panel["targets"].append({"expr": "mmserve_time_to_first_token_seconds_total", "refId": "Y"})
    panel["targets"].append({"expr": "sum by (modality) (mmserve_kv_blocks_free)", "refId": "X"})
    found = problems(dashboard, exported)
    assert any("mmserve_prompt_tokens is not exported" in p for p in found)  # the suffix counts
    assert any("mmserve_time_to_first_token_seconds_total is not exported" in p for p in found)
    assert any("grouping by 'modality'" in p for p in found)


def test_the_dashboard_covers_the_issues_series_and_imports_anywhere(exported) -> None:
    dashboard = _dashboard()
    used = {name for _, expr in expressions(dashboard) for name, _ in METRIC_REF.findall(expr)}
    for name in (
        "mmserve_request_success_total",
        "mmserve_prompt_tokens_total",
        "mmserve_generation_tokens_total",
        "mmserve_time_to_first_token_seconds_bucket",
        "mmserve_inter_token_latency_seconds_bucket",
        "mmserve_e2e_request_latency_seconds_bucket",
        "mmserve_request_queue_time_seconds_bucket",
        "mmserve_kv_cache_usage_perc",
        "mmserve_prefix_cache_hits_total",
        "mmserve_processor_cache_hits_total",
        "mmserve_encoder_cache_hits_total",
        "mmserve_encoder_cache_used_slots",
        "mmserve_encoder_items_encoded_total",
        "mmserve_encoder_forward_calls_total",
        "mmserve_embedding_transfer_bytes_total",
        "mmserve_num_requests_running",
        "mmserve_num_requests_waiting",
        "mmserve_num_preemptions_total",
        "mmserve_remote_encoder_items_total",
        "mmserve_encoder_items_received_total",
    ):
        assert name in used, name
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["multi"] and variables["instance"]["includeAll"]
    panels = list(_panels(dashboard["panels"]))
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["description"], panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
    # the engine's panels follow the server and model selectors
    for where, expr in expressions(dashboard):
        if where.startswith("panel") and 'model_name=""' not in expr:
            assert 'instance=~"$instance"' in expr and 'model_name=~"$model_name"' in expr, where
    assert "mmserve_dp_routed_requests_total" in used


def replica_problems(dashboard: dict) -> list[str]:
    """A series a data-parallel server exports per replica beside its total must say which it
    reads (`replica=""`: the total, as a single-replica server exports it; `replica!=""`: the
    replicas), or a sum over it counts everything twice. (Variables only list label values.)"""
    exported = _samples(_data_parallel_exposition())
    per_replica = {name for name, labels in exported.items() if "replica" in labels}
    says_which = re.compile(r'\breplica\s*(=~|!~|!=|=)\s*"')
    found = []
    for where, expr in expressions(dashboard):
        if not where.startswith("panel"):
            continue
        for name, matchers in METRIC_REF.findall(expr):
            encode_server = 'model_name=""' in matchers  # its own series: no replicas
            if name in per_replica and not encode_server and not says_which.search(matchers):
                found.append(f"{where}: {name} without a replica matcher")
    return found


def test_every_query_over_a_per_replica_series_says_total_or_replicas() -> None:
    assert replica_problems(_dashboard()) == []
    dashboard = _dashboard()
    panel = next(p for p in _panels(dashboard["panels"]) if p.get("targets"))
    expr = 'sum(rate(mmserve_encoder_cache_hits_total{model_name=~"$model_name"}[5m]))'
    panel["targets"].append({"expr": expr, "refId": "Z"})
    assert replica_problems(dashboard) == [
        f"panel {panel['title']!r}: mmserve_encoder_cache_hits_total without a replica matcher"
    ]
