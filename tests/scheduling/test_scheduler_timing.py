"""What the scheduler tells the metrics: when each request was first scheduled, preemptions."""

from __future__ import annotations

import itertools

from mmserve.config import CacheConfig, SchedulerConfig
from tests.support.fake_runner import FakeRunner, make_request, make_scheduler, run_step


def _scheduler(num_blocks: int = 200, max_num_batched_tokens: int = 256):
    clock = itertools.count(100.0, 1.0)  # each schedule() reads the next second
    return make_scheduler(
        SchedulerConfig(max_model_len=1024, max_num_batched_tokens=max_num_batched_tokens),
        CacheConfig(num_blocks=num_blocks, block_size=16),
        eos_token_ids=[2],
        clock=lambda: next(clock),
    )


def test_the_first_update_carries_the_first_schedule_time_and_later_ones_do_not():
    scheduler = _scheduler(max_num_batched_tokens=32)
    runner = FakeRunner(256, 16)
    scheduler.add_request(make_request("a", 70, max_tokens=3))  # prefill in 3 chunks
    run_step(scheduler, runner)  # step at t=100: first chunk, no update
    scheduler.add_request(make_request("b", 10, max_tokens=3))  # waits behind a's chunks
    times: dict[str, list[float | None]] = {"a": [], "b": []}
    for _ in range(20):
        if not scheduler.has_unfinished_requests():
            break
        _, updates = run_step(scheduler, runner)
        for update in updates:
            times[update.request_id].append(update.first_scheduled_time_s)
    # a was first scheduled by the first step (t=100), even though its first token came at
    # t=102; b got the token budget a's last chunk left at t=102.
    assert times["a"] == [100.0, None, None]
    assert times["b"] == [102.0, None, None]


def test_a_preempted_request_keeps_its_first_schedule_time_and_preemptions_are_counted():
    # 10 blocks of 16: two 60-token prompts growing to 100 tokens cannot coexist.
    scheduler = _scheduler(num_blocks=10)
    runner = FakeRunner(256, 16, sample=lambda rid, pos: 1000 + pos)
    scheduler.add_request(make_request("old", 60, max_tokens=40))
    scheduler.add_request(make_request("new", 60, max_tokens=40, text_seed=3))
    reported: dict[str, list[float]] = {"old": [], "new": []}
    num_preempted = 0
    for _ in range(300):
        if not scheduler.has_unfinished_requests():
            break
        out, updates = run_step(scheduler, runner)
        num_preempted += len(out.preempted_req_ids)
        if "new" in scheduler.requests and out.preempted_req_ids:
            assert scheduler.requests["new"].first_scheduled_time_s == 100.0
        for update in updates:
            if update.first_scheduled_time_s is not None:
                reported[update.request_id].append(update.first_scheduled_time_s)
    assert num_preempted >= 1
    assert scheduler.num_preemptions == num_preempted
    # Each reported once, the time of the first schedule: the wait after a preemption is not
    # queue time (vLLM counts only the first wait too).
    assert reported == {"old": [100.0], "new": [100.0]}
