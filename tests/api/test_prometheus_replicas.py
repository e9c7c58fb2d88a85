"""/metrics of a data-parallel engine: each engine-core series per replica (label `replica`)
beside its total, which is what one replica's server exports; the API process's series once."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from mmserve.api.prometheus import build_registry, render
from mmserve.engine.frontend.request_timing import RequestTimes
from mmserve.metrics import CORE_SERIES, EngineMetrics

MODEL = "Qwen/Qwen2-VL-2B-Instruct"


def _front_counts(metrics: EngineMetrics) -> None:
    """What the API process counts: tokens, a finished request, the processor cache."""
    metrics.inc("prompt_tokens", 20)
    metrics.inc("generation_tokens", 2)
    metrics.inc("processor_cache_queries", 4)
    metrics.set_counter("processor_cache_hits", 1)
    times = RequestTimes(arrival_s=0.0)
    times.on_scheduled(0.25)
    times.on_tokens(0.5)
    metrics.record_finished(times.finished(1.0, "length", 20, 2))


def _core_counts(metrics: EngineMetrics, k: int) -> None:
    """What one engine core counts (k scales it, so that replicas differ)."""
    metrics.set_gauge("kv_blocks_total", 40)
    metrics.set_gauge("kv_blocks_free", 40 - 10 * k)
    metrics.set_gauge("num_requests_running", k)
    metrics.set_gauge("remote_encoder_healthy", 1 + k)
    metrics.set_counter("encoder_cache_queries", 6 * k)
    metrics.set_counter("encoder_cache_hits", 4 * k)
    metrics.inc("encoder_items_encoded", 2 * k, modality="image")
    metrics.inc_labelled("remote_encoder_items", "http://10.0.0.2:9000", k)
    metrics.inc_labelled("embedding_transfer_bytes", "received", 100 * k)


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL, sample
            labels = frozenset((k, v) for k, v in sample.labels.items() if k != "model_name")
            out[(sample.name, labels)] = sample.value
    return out


def _replicated(counts: list[int]) -> tuple[EngineMetrics, list[EngineMetrics]]:
    replicas = [EngineMetrics(max_model_len=64) for _ in counts]
    for metrics, k in zip(replicas, counts, strict=True):
        _core_counts(metrics, k)
    front = EngineMetrics(max_model_len=64, replicas=replicas)
    _front_counts(front)
    return front, replicas


def test_one_replica_renders_exactly_as_a_single_engine() -> None:
    single = EngineMetrics(max_model_len=64)
    _front_counts(single)
    _core_counts(single, 1)
    front, replicas = _replicated([1])
    want = render(build_registry(single, MODEL))
    assert render(build_registry(front, MODEL)) == want
    plain_front = EngineMetrics(max_model_len=64)
    _front_counts(plain_front)
    assert render(build_registry(plain_front, MODEL, replicas=replicas)) == want


def test_two_replicas_each_core_series_per_replica_and_its_total() -> None:
    front, _ = _replicated([1, 2])
    got = _samples(render(build_registry(front, MODEL)).decode())

    def at(name: str, replica: str | None = None, **labels: str) -> float:
        if replica is not None:
            labels["replica"] = replica
        return got[(name, frozenset(labels.items()))]

    hits = "mmserve_encoder_cache_hits_total"
    assert (at(hits, "0"), at(hits, "1"), at(hits)) == (4, 8, 12)
    encoded = "mmserve_encoder_items_encoded_total"
    assert at(encoded, "1", modality="image") == 4 and at(encoded, modality="image") == 6
    url = {"encoder": "http://10.0.0.2:9000"}
    assert at("mmserve_remote_encoder_items_total", "0", **url) == 1
    assert at("mmserve_remote_encoder_items_total", **url) == 3
    sent = {"direction": "sent"}
    assert at("mmserve_embedding_transfer_bytes_total", "1", direction="received") == 200
    assert at("mmserve_embedding_transfer_bytes_total", **sent) == 0  # present from the start
    assert at("mmserve_num_requests_running") == 3
    assert at("mmserve_kv_blocks_free") == 50 and at("mmserve_kv_blocks_total") == 80
    # usage of all blocks (30 of 80 held), not a sum of the replicas' ratios (0.25 + 0.5)
    assert at("mmserve_kv_cache_usage_perc") == 30 / 80
    assert at("mmserve_kv_cache_usage_perc", "1") == 0.5
    # every replica reaches the same pool: the most encoders any one has, not their sum
    assert at("mmserve_remote_encoder_healthy") == 3
    # the API process's series: once, without the label
    assert at("mmserve_prompt_tokens_total") == 20
    assert at("mmserve_processor_cache_hits_total") == 1
    assert at("mmserve_request_success_total", finished_reason="length") == 1
    replica_labelled = {name for name, labels in got if any(k == "replica" for k, _ in labels)}
    assert "mmserve_prompt_tokens_total" not in replica_labelled
    assert not any(n.startswith("mmserve_time_to_first_token") for n in replica_labelled)
    # both routing reasons exist from the start
    routed = "mmserve_dp_routed_requests_total"
    assert at(routed, reason="affinity") == 0 and at(routed, reason="load") == 0


def test_every_core_series_has_its_total_and_one_sample_per_replica() -> None:
    front, _ = _replicated([1, 2, 3])
    got = _samples(render(build_registry(front, MODEL)).decode())
    by_name: dict[str, list[frozenset]] = {}
    for name, labels in got:
        by_name.setdefault(name, []).append(labels)
    core = {f"mmserve_{n}" for n in CORE_SERIES} | {f"mmserve_{n}_total" for n in CORE_SERIES}
    core.add("mmserve_kv_cache_usage_perc")
    for name, label_sets in by_name.items():
        replicas = sorted(dict(ls).get("replica", "") for ls in label_sets)
        if name in core:
            groups = len(label_sets) // 4
            assert replicas == [""] * groups + ["0"] * groups + ["1"] * groups + ["2"] * groups
            # the total of each label set is the replicas' sum (or their max, for the pool)
            for labels in label_sets:
                if "replica" in dict(labels):
                    continue
                parts = [got[(name, labels | {("replica", r)})] for r in "012"]
                if name == "mmserve_remote_encoder_healthy":
                    assert got[(name, labels)] == max(parts)
                elif name != "mmserve_kv_cache_usage_perc":
                    assert got[(name, labels)] == sum(parts), name
        else:
            assert set(replicas) == {""}, name


def test_the_routing_counter_counts_by_reason() -> None:
    front, _ = _replicated([0, 0])
    front.inc_labelled("dp_routed_requests", "affinity", 5)
    front.inc_labelled("dp_routed_requests", "load")
    got = _samples(render(build_registry(front, MODEL)).decode())
    routed = "mmserve_dp_routed_requests_total"
    assert got[(routed, frozenset({("reason", "affinity")}))] == 5
    assert got[(routed, frozenset({("reason", "load")}))] == 1
    # a single engine routes nothing: no routing series until something is counted
    single = _samples(render(build_registry(EngineMetrics(), MODEL)).decode())
    assert not any(name == routed for name, _ in single)


def test_the_replicas_list_is_read_at_every_scrape() -> None:
    """The engine may hand the list of its replicas' metrics and replace an entry in place (a
    restarted replica); a single core may be its own one replica."""
    single = EngineMetrics(max_model_len=64)
    _front_counts(single)
    _core_counts(single, 1)
    assert render(build_registry(single, MODEL, replicas=[single])) == render(
        build_registry(single, MODEL)
    )
    replicas = [EngineMetrics(max_model_len=64), EngineMetrics(max_model_len=64)]
    _core_counts(replicas[1], 2)
    front = EngineMetrics(max_model_len=64)
    registry = build_registry(front, MODEL, replicas=replicas)
    running = ("mmserve_num_requests_running", frozenset({("replica", "1")}))
    assert _samples(render(registry).decode())[running] == 2
    replicas[1] = EngineMetrics(max_model_len=64)
    _core_counts(replicas[1], 3)
    assert _samples(render(registry).decode())[running] == 3
