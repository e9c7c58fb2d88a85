"""EngineMetrics bookkeeping: per-request phases, token histograms, finish reasons, KV usage."""

from __future__ import annotations

import pytest

from mmserve.engine.frontend.request_timing import RequestTimes
from mmserve.metrics import (
    FINISHED_REASONS,
    PHASE_HISTOGRAMS,
    EngineMetrics,
    FinishedRequestStats,
    token_buckets,
)
from mmserve.updates import FINISH_REASONS


def test_token_buckets_are_the_1_2_5_series_up_to_the_model_length():
    assert token_buckets(10) == (1, 2, 5, 10)
    assert token_buckets(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert token_buckets(1) == (1,)


def test_finish_reasons_are_the_ones_outputs_carry():
    assert set(FINISHED_REASONS) == set(FINISH_REASONS.values())
    with pytest.raises(ValueError, match="finish_reason"):
        FinishedRequestStats("timeout", 1, 1, 1.0, None, None, None, None)


def test_phases_of_a_request_that_ran_to_the_end():
    times = RequestTimes(arrival_s=10.0)
    times.on_scheduled(10.5)
    times.on_tokens(11.25)  # first token
    times.on_scheduled(12.0)  # re-scheduled after a preemption: not a new first schedule
    times.on_tokens(12.5)
    times.on_tokens(14.0)  # last token
    stats = times.finished(14.5, "length", num_prompt_tokens=30, num_generation_tokens=3)
    assert stats.phases_s() == {
        "e2e_request_latency_seconds": 4.5,
        "request_queue_time_seconds": 0.5,
        "request_prefill_time_seconds": 0.75,
        "request_decode_time_seconds": 2.75,
        "request_inference_time_seconds": 3.5,
    }


def test_a_request_aborted_while_waiting_has_only_its_end_to_end_latency():
    stats = RequestTimes(arrival_s=3.0).finished(5.0, "abort", 7, 0)
    phases = stats.phases_s()
    assert phases.pop("e2e_request_latency_seconds") == 2.0
    assert set(phases.values()) == {None}
    scheduled = RequestTimes(arrival_s=3.0)
    scheduled.on_scheduled(4.0)  # scheduled, aborted before its first token
    assert scheduled.finished(5.0, "abort", 7, 0).phases_s()["request_queue_time_seconds"] == 1.0
    assert scheduled.finished(5.0, "abort", 7, 0).prefill_time_s is None


def test_record_finished_observes_each_known_phase_once_and_counts_the_reason():
    metrics = EngineMetrics(max_model_len=100)
    ran = RequestTimes(arrival_s=0.0)
    ran.on_scheduled(0.1)
    ran.on_tokens(0.4)
    ran.on_tokens(2.0)
    metrics.record_finished(ran.finished(2.0, "stop", 12, 2))
    metrics.record_finished(RequestTimes(arrival_s=0.0).finished(1.0, "abort", 60, 0))
    snap = metrics.snapshot()
    assert snap.request_success == {"stop": 1, "length": 0, "abort": 1, "error": 0}
    h = snap.histograms
    assert h["e2e_request_latency_seconds"].num == 2
    assert h["e2e_request_latency_seconds"].total == pytest.approx(3.0)
    for name in set(PHASE_HISTOGRAMS) - {"e2e_request_latency_seconds"}:
        assert h[name].num == 1, name  # the aborted request never reached these phases
    assert h["request_decode_time_seconds"].total == pytest.approx(1.6)
    prompt = h["request_prompt_tokens"]
    assert prompt.buckets == (1, 2, 5, 10, 20, 50, 100)
    assert (prompt.num, prompt.total) == (2, 72)
    assert prompt.counts == [0, 0, 0, 0, 1, 0, 1, 0]  # 12 in (10, 20], 60 in (50, 100]
    assert h["request_generation_tokens"].counts[:3] == [1, 1, 0]  # 0 in le=1, 2 in le=2


def test_kv_cache_usage_counts_held_blocks_and_is_zero_before_the_pool_exists():
    metrics = EngineMetrics()
    assert metrics.snapshot().kv_cache_usage == 0.0
    metrics.set_gauge("kv_blocks_total", 64)
    metrics.set_gauge("kv_blocks_free", 48)
    assert metrics.snapshot().kv_cache_usage == 0.25


def test_a_snapshot_does_not_move_with_later_observations():
    metrics = EngineMetrics()
    metrics.observe_ttft(0.2)
    snap = metrics.snapshot()
    metrics.observe_ttft(0.3)
    metrics.record_finished(RequestTimes(arrival_s=0.0).finished(1.0, "stop", 1, 1))
    assert snap.ttft.num == 1 and snap.request_success["stop"] == 0
