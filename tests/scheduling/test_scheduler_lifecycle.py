"""Request lifecycle: stop rules, partial prefills, preemption, aborts, runner errors, limits."""

from __future__ import annotations

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.scheduling import Scheduler
from mmserve.updates import RequestStatus
from tests.support.fake_runner import FakeRunner, make_request, make_scheduler, run_step

EOS = 2


def _setup(num_blocks: int = 200, max_model_len: int = 1024, **kwargs):
    kwargs.setdefault("max_num_batched_tokens", 256)
    scheduler = make_scheduler(
        SchedulerConfig(max_model_len=max_model_len, **kwargs),
        CacheConfig(num_blocks=num_blocks, block_size=16),
        eos_token_ids=[EOS],
    )
    return scheduler


def _finish_all(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 500) -> dict:
    results: dict[str, tuple[list[int], RequestStatus]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return results
        _, updates = run_step(scheduler, runner)
        for u in updates:
            tokens, _ = results.get(u.request_id, ([], None))
            results[u.request_id] = (tokens + u.new_token_ids, u.finish_status)
    raise AssertionError("requests did not finish")


def test_stop_rules_eos_min_tokens_ignore_eos_stop_tokens_and_lengths():
    scheduler = _setup(max_model_len=40)
    tokens = {"eos": [5, EOS], "min": [EOS, EOS, EOS, 9], "ign": [EOS] * 4, "stop": [5, 42, 6]}
    runner = FakeRunner(256, 16, sample=lambda rid, pos: tokens[rid][pos - 20])
    scheduler.add_request(make_request("eos", 20, max_tokens=10))
    scheduler.add_request(make_request("min", 20, max_tokens=10, min_tokens=3))
    scheduler.add_request(make_request("ign", 20, max_tokens=4, ignore_eos=True))
    scheduler.add_request(make_request("stop", 20, max_tokens=10, stop_token_ids=(42,)))
    tokens["len"] = [8] * 30
    scheduler.add_request(make_request("len", 20, max_tokens=100))  # max_model_len 40 stops it
    results = _finish_all(scheduler, runner)
    assert results["eos"] == ([5, EOS], RequestStatus.FINISHED_STOPPED)
    assert results["min"] == ([EOS, EOS, EOS], RequestStatus.FINISHED_STOPPED)
    assert results["ign"] == ([EOS] * 4, RequestStatus.FINISHED_LENGTH)
    assert results["stop"] == ([5, 42], RequestStatus.FINISHED_STOPPED)
    assert results["len"] == ([8] * 20, RequestStatus.FINISHED_LENGTH)


def test_partial_prefill_yields_no_token_and_the_runner_sees_the_window():
    scheduler = _setup(max_num_batched_tokens=32)
    runner = FakeRunner(256, 16)
    scheduler.add_request(make_request("a", 70, max_tokens=2))
    steps = []
    for _ in range(4):
        out, updates = run_step(scheduler, runner)
        (cached_or_new,) = out.scheduled_new_reqs or out.scheduled_cached_reqs
        steps.append((cached_or_new.num_computed_tokens, out.num_scheduled_tokens["a"], updates))
    assert [s[:2] for s in steps] == [(0, 32), (32, 32), (64, 6), (70, 1)]
    assert steps[0][2] == [] and steps[1][2] == []
    assert steps[2][2][0].new_token_ids == [7] and not steps[2][2][0].finished
    assert steps[3][2][0].finish_status == RequestStatus.FINISHED_LENGTH


def test_preemption_frees_the_newest_and_it_resumes_with_its_generated_tokens():
    # 10 blocks of 16: two 60-token prompts (4 blocks each) growing to 100 tokens cannot coexist.
    scheduler = _setup(num_blocks=10)
    runner = FakeRunner(256, 16, sample=lambda rid, pos: 1000 + pos)
    scheduler.add_request(make_request("old", 60, [("img-o", 4, 20)], max_tokens=40))
    scheduler.add_request(make_request("new", 60, [("img-n", 4, 20)], max_tokens=40, text_seed=3))
    preempted_at, resumed = None, None
    for step in range(300):
        if not scheduler.has_unfinished_requests():
            break
        out, _ = run_step(scheduler, runner)
        if out.preempted_req_ids and preempted_at is None:
            assert out.preempted_req_ids == {"new"}
            victim = scheduler.requests["new"]
            assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
            assert scheduler.waiting[0] is victim
            assert not any("new" in h for h in scheduler.encoder_cache_manager.cached.values())
            generated = list(victim.output_token_ids)
            preempted_at = step
        for new in out.scheduled_new_reqs:
            if new.request_id == "new" and preempted_at is not None and resumed is None:
                resumed = new
    assert preempted_at is not None and resumed is not None
    assert resumed.token_ids[60:] == generated and generated
    assert not scheduler.has_unfinished_requests()
    assert scheduler.make_stats().num_free_kv_blocks == 10


def test_abort_frees_blocks_and_encoder_references_in_the_same_call():
    scheduler = _setup(
        max_num_batched_tokens=40, max_tokens_per_mm_item=50, max_patches_per_mm_item=200
    )
    runner = FakeRunner(50, 16)
    scheduler.add_request(make_request("a", 100, [("img-a", 10, 50)], max_tokens=5))
    scheduler.add_request(make_request("w", 30, max_tokens=5))
    run_step(scheduler, runner)  # "a" is mid-image, holding its encoder entry and 3 blocks
    assert scheduler.encoder_cache_manager.cached["img-a"] == {"a"}
    scheduler.finish_requests(["a", "w", "unknown"], RequestStatus.FINISHED_ABORTED)
    scheduler.check_integrity()
    assert scheduler.kv_cache_manager.num_free_blocks == 200
    assert scheduler.encoder_cache_manager.cached["img-a"] == set()  # resident, freeable
    assert not scheduler.has_unfinished_requests()
    out = scheduler.schedule()
    assert out.finished_req_ids == {"a", "w"} and out.total_num_scheduled_tokens == 0


def test_runner_error_fails_only_that_request():
    scheduler = _setup()
    runner = FakeRunner(256, 16)
    runner.fail_ids.add("bad")
    scheduler.add_request(make_request("bad", 40, [("img-b", 5, 20)], max_tokens=3))
    scheduler.add_request(make_request("good", 40, max_tokens=3))
    out, updates = run_step(scheduler, runner)
    (bad,) = [u for u in updates if u.request_id == "bad"]
    assert bad.finish_status == RequestStatus.FINISHED_ERROR and "placeholders" in bad.error.message
    assert scheduler.encoder_cache_manager.cached["img-b"] == set()
    results = _finish_all(scheduler, runner)
    assert results["good"][1] == RequestStatus.FINISHED_LENGTH
    assert scheduler.kv_cache_manager.num_free_blocks == 200


def test_max_num_seqs_and_token_budget_bound_every_step():
    scheduler = _setup(max_num_seqs=3, max_num_batched_tokens=200)
    runner = FakeRunner(256, 16)
    for i in range(8):
        scheduler.add_request(make_request(f"r{i}", 30 + i, text_seed=i, max_tokens=4))
    stats_seen = []
    while scheduler.has_unfinished_requests():
        out, _ = run_step(scheduler, runner)
        assert len(out.num_scheduled_tokens) <= 3 and out.total_num_scheduled_tokens <= 200
        assert len(scheduler.running) <= 3
        stats_seen.append(scheduler.make_stats())
    assert max(s.num_running for s in stats_seen) == 3
    assert stats_seen[0].num_waiting == 5 and stats_seen[-1].num_running == 0
