"""The pool's metrics: labelled counters cross the engine-process seam and reach /metrics."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmserve.api.prometheus import build_registry, render
from mmserve.metrics import EngineMetrics, SchedulerStats, record_scheduler_stats
from mmserve.wire import EngineCoreOutputs, codec
from mmserve.wire.common import WireError

URL_A, URL_B = "http://10.0.0.1:8100", "http://10.0.0.2:8100"


def _zero_stats() -> SchedulerStats:
    return SchedulerStats(
        **dict.fromkeys((f.name for f in msgspec.structs.fields(SchedulerStats) if f.required), 0)
    )


def _engine_side() -> EngineMetrics:
    metrics = EngineMetrics()
    metrics.inc_labelled("embedding_transfer_bytes", "sent", 1000)
    metrics.inc_labelled("embedding_transfer_bytes", "received", 7168)
    metrics.inc_labelled("remote_encoder_items", URL_A)
    metrics.inc_labelled("remote_encoder_items", URL_B, 2)
    metrics.inc_labelled("remote_encoder_latency_seconds", URL_B, 0.25)
    metrics.inc_labelled("remote_encoder_dropped_messages", "bad_mac")
    metrics.inc("remote_encoder_retries")
    metrics.set_gauge("remote_encoder_healthy", 2)
    return metrics


def test_labelled_counters_cross_the_seam_and_are_exported_by_label():
    snap = _engine_side().snapshot()
    assert snap.counters["embedding_transfer_bytes"] == 8168  # the total of its labels
    stats = _zero_stats()
    sent = msgspec.structs.replace(
        stats,
        counters={"remote_encoder_retries": 1, "embedding_transfer_bytes": 8168},
        gauges={"remote_encoder_healthy": 2.0},
        labelled_counters={k: dict(v) for k, v in snap.labelled_counters.items()},
    )
    msg = codec.decode([bytes(f) for f in codec.encode(EngineCoreOutputs([], sent))])
    assert isinstance(msg, EngineCoreOutputs) and msg.stats == sent
    api_side = EngineMetrics()
    record_scheduler_stats(api_side, msg.stats)
    text = render(build_registry(api_side, "m")).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {
        (f.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    assert samples[("mmserve_remote_encoder_items", (("encoder", URL_B), ("model_name", "m")))]
    assert families["mmserve_remote_encoder_items"].samples[1].value == 2
    transfer = {
        s.labels["direction"]: s.value for s in families["mmserve_embedding_transfer_bytes"].samples
    }
    assert transfer == {"received": 7168, "sent": 1000}
    latency = families["mmserve_remote_encoder_latency_seconds"].samples
    assert [(s.labels["encoder"], s.value) for s in latency] == [(URL_B, 0.25)]
    dropped = families["mmserve_remote_encoder_dropped_messages"].samples
    assert [(s.labels["reason"], s.value) for s in dropped] == [("bad_mac", 1)]
    assert families["mmserve_remote_encoder_retries"].samples[0].value == 1
    assert families["mmserve_remote_encoder_healthy"].samples[0].value == 2


def test_without_a_pool_the_transfer_series_exist_at_zero_and_the_others_are_absent():
    text = render(build_registry(EngineMetrics(), "m")).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    transfer = families["mmserve_embedding_transfer_bytes"].samples
    assert sorted((s.labels["direction"], s.value) for s in transfer) == [
        ("received", 0),
        ("sent", 0),
    ]
    assert "mmserve_remote_encoder_items" not in families


def test_unknown_labelled_counters_are_refused_on_the_wire_and_here():
    with pytest.raises(ValueError, match="unknown metrics"):
        msgspec.structs.replace(_zero_stats(), labelled_counters={"made_up": {"x": 1.0}})
    stats = msgspec.structs.replace(_zero_stats(), labelled_counters={"remote_encoder_items": {}})
    frames = [bytes(f) for f in codec.encode(EngineCoreOutputs([], stats))]
    # the same bytes naming a metric nobody keeps (a name of the same length)
    frames[0] = frames[0].replace(b"remote_encoder_items", b"made_up_metric_items")
    with pytest.raises(WireError, match="unknown metrics"):
        codec.decode(frames)
    with pytest.raises(KeyError, match="not kept by label"):
        EngineMetrics().inc_labelled("prompt_tokens", "x")
