"""The /metrics exposition: model_name on every series, units in HELP, vLLM's names, the doc."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from mmserve.api.prometheus import build_registry, render
from mmserve.engine.frontend.request_timing import RequestTimes
from mmserve.metrics import COUNTER_NAMES, EngineMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
UNITS = {"items", "calls", "tokens", "bytes", "requests", "events", "blocks", "embeddings"}
UNITS |= {"seconds", "ratio, 0 to 1", "encoders"}
# vLLM's series that a Grafana dashboard reads, by the name mmserve gives them.
VLLM_COUNTERPARTS = {
    "vllm:e2e_request_latency_seconds": "mmserve_e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds": "mmserve_request_queue_time_seconds",
    "vllm:request_prefill_time_seconds": "mmserve_request_prefill_time_seconds",
    "vllm:request_decode_time_seconds": "mmserve_request_decode_time_seconds",
    "vllm:request_inference_time_seconds": "mmserve_request_inference_time_seconds",
    "vllm:time_to_first_token_seconds": "mmserve_time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "mmserve_inter_token_latency_seconds",
    "vllm:prompt_tokens_total": "mmserve_prompt_tokens",
    "vllm:generation_tokens_total": "mmserve_generation_tokens",
    "vllm:request_prompt_tokens": "mmserve_request_prompt_tokens",
    "vllm:request_generation_tokens": "mmserve_request_generation_tokens",
    "vllm:request_success_total": "mmserve_request_success",
    "vllm:num_requests_running": "mmserve_num_requests_running",
    "vllm:num_requests_waiting": "mmserve_num_requests_waiting",
    "vllm:kv_cache_usage_perc": "mmserve_kv_cache_usage_perc",
    "vllm:num_preemptions_total": "mmserve_num_preemptions",
    "vllm:prefix_cache_queries_total": "mmserve_prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "mmserve_prefix_cache_hits",
}


def _families(metrics: EngineMetrics, model_name: str = "Qwen/Qwen2-VL-2B-Instruct"):
    text = render(build_registry(metrics, model_name)).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _busy_metrics() -> EngineMetrics:
    metrics = EngineMetrics(max_model_len=64)
    metrics.set_gauge("kv_blocks_total", 40)
    metrics.set_gauge("kv_blocks_free", 30)
    metrics.inc("num_preemptions", 2)
    times = RequestTimes(arrival_s=0.0)
    times.on_scheduled(0.25)
    times.on_tokens(0.5)
    times.on_tokens(0.9)
    metrics.record_finished(times.finished(1.0, "length", 20, 2))
    metrics.record_finished(RequestTimes(arrival_s=0.0).finished(0.1, "abort", 3, 0))
    return metrics


def test_every_sample_names_the_served_model():
    families = _families(_busy_metrics())
    assert len(families) > 30
    for family in families.values():
        assert family.samples, family.name
        for sample in family.samples:
            assert sample.labels.get("model_name") == "Qwen/Qwen2-VL-2B-Instruct", sample


def test_help_texts_give_the_unit():
    for family in _families(EngineMetrics()).values():
        unit = re.fullmatch(r".+ \((.+)\)\.", family.documentation)
        assert unit is not None and unit.group(1) in UNITS, (family.name, family.documentation)


def test_vllm_dashboard_series_have_a_counterpart_of_the_same_kind():
    families = _families(_busy_metrics())
    for vllm_name, name in VLLM_COUNTERPARTS.items():
        assert name in families, vllm_name
    assert families["mmserve_kv_cache_usage_perc"].samples[0].value == 0.25
    assert families["mmserve_num_preemptions"].samples[0].value == 2
    assert families["mmserve_request_queue_time_seconds"].type == "histogram"
    success = {
        s.labels["finished_reason"]: s.value
        for s in families["mmserve_request_success"].samples
        if s.name.endswith("_total")
    }
    assert success == {"stop": 0, "length": 1, "abort": 1, "error": 0}


def test_histograms_are_cumulative_and_count_finished_requests():
    families = _families(_busy_metrics())
    e2e = {
        s.labels.get("le"): s.value for s in families["mmserve_e2e_request_latency_seconds"].samples
    }
    assert e2e["0.3"] == 1 and e2e["1.0"] == 2 and e2e["+Inf"] == 2
    prompt = families["mmserve_request_prompt_tokens"].samples
    bounds = [s.labels["le"] for s in prompt if s.name.endswith("_bucket")]
    assert bounds == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "+Inf"]  # up to max_model_len
    queue = families["mmserve_request_queue_time_seconds"].samples
    assert [s.value for s in queue if s.name.endswith("_count")] == [1]  # the abort never ran


def test_the_doc_lists_every_series():
    doc = DOC.read_text()
    counters = {f"mmserve_{name}" for name in (*COUNTER_NAMES, "request_success")}
    for name in _families(EngineMetrics()):
        exported = name + "_total" if name in counters else name
        assert f"`{exported}`" in doc or f"`{exported}{{" in doc, exported
    for vllm_name in VLLM_COUNTERPARTS:
        assert f"`{vllm_name}`" in doc, vllm_name


def _by_modality(families, name: str) -> dict[str, float]:
    samples = families[f"mmserve_{name}"].samples
    return {s.labels["modality"]: s.value for s in samples if s.name.endswith("_total")}


def test_encoder_counters_carry_a_modality_label_from_the_start():
    metrics = EngineMetrics()
    families = _families(metrics)
    # a dashboard finds both series before any video arrives
    assert _by_modality(families, "encoder_forward_calls") == {"image": 0, "video": 0}
    metrics.inc("encoder_forward_calls", modality="image")
    metrics.inc("encoder_forward_calls", modality="video")
    metrics.inc("encoder_items_encoded", 2, modality="image")
    metrics.inc("encoder_items_encoded", 1, modality="video")
    families = _families(metrics)
    assert _by_modality(families, "encoder_forward_calls") == {"image": 1, "video": 1}
    assert _by_modality(families, "encoder_items_encoded") == {"image": 2, "video": 1}
