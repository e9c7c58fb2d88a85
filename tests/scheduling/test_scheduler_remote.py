"""Scheduler x remote items: in flight until they arrive, cancelled with their last holder."""

from __future__ import annotations

import msgspec

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.errors import FailureKind, RequestFailure
from mmserve.scheduling import Request, RequestStatus, Scheduler
from tests.support.fake_runner import FakeRunner, make_request, make_scheduler, run_step

EMBED_BYTES = 8


def _setup(num_blocks: int = 1000, block_size: int = 16, **kwargs) -> tuple[Scheduler, FakeRunner]:
    kwargs.setdefault("max_model_len", 4096)
    kwargs.setdefault("max_num_batched_tokens", 256)
    config = SchedulerConfig(encoder_embed_bytes=EMBED_BYTES, **kwargs)
    scheduler = make_scheduler(config, CacheConfig(num_blocks=num_blocks, block_size=block_size))
    runner = FakeRunner(config.effective_encoder_cache_size, block_size)
    return scheduler, runner


def _remote(request: Request) -> Request:
    """The request with every item made remote (as a disaggregated server's processor does)."""
    for i, f in enumerate(request.mm_features):
        request.mm_features[i] = msgspec.structs.replace(f, is_remote=True)
    return request


def _req(rid: str, images: list[tuple[str, int, int]], num_tokens: int, **kwargs) -> Request:
    kwargs.setdefault("ignore_eos", True)
    kwargs.setdefault("max_tokens", 4)
    kwargs.setdefault("text_seed", sum(map(ord, rid)))
    return _remote(make_request(rid, num_tokens, images, **kwargs))


def _assert_all_free(scheduler: Scheduler) -> None:
    scheduler.check_integrity()
    manager = scheduler.encoder_cache_manager
    assert not scheduler.requests
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.cache_config.num_blocks
    assert manager.num_referenced_bytes == 0 and not manager.inflight
    assert manager.num_inflight_bytes == 0


def test_text_before_an_item_in_flight_runs_while_another_request_decodes() -> None:
    scheduler, runner = _setup()
    scheduler.add_request(make_request("text", 8, max_tokens=6, ignore_eos=True))
    scheduler.add_request(_req("img", [("a", 10, 20), ("b", 40, 8)], 60))
    out, _ = run_step(scheduler, runner)
    # both items in the window are sent at once; the window stops at the first one
    assert [f.identifier for f in out.remote_encoder_inputs["img"]] == ["a", "b"]
    assert out.num_scheduled_tokens["img"] == 10
    assert not out.scheduled_encoder_inputs
    stats = scheduler.make_stats()
    assert stats.encoder_inflight_items == 2
    assert stats.encoder_inflight_bytes == 28 * EMBED_BYTES
    for _ in range(3):  # nothing arrives: "img" stays at the item, "text" decodes
        out, updates = run_step(scheduler, runner)
        assert "img" not in out.num_scheduled_tokens and out.num_scheduled_tokens["text"] == 1
        assert scheduler.requests["img"].num_computed_tokens == 10
        assert not out.remote_encoder_inputs  # never sent again
    assert scheduler.make_stats().encoder_pool_bytes == 0  # nothing arrived yet
    runner.deliver = {"a"}
    run_step(scheduler, runner)  # the runner reports "a" arrived
    assert scheduler.make_stats().encoder_pool_bytes == 20 * EMBED_BYTES
    out, _ = run_step(scheduler, runner)
    assert out.num_scheduled_tokens["img"] == 30  # up to "b", still in flight
    runner.deliver = {"b"}
    for _ in range(20):
        run_step(scheduler, runner)
    assert runner.num_remote_sent == 2 and not runner.cancelled
    _assert_all_free(scheduler)
    # both stay resident for reuse: the pool holds them until evicted
    assert scheduler.make_stats().encoder_pool_bytes == 28 * EMBED_BYTES


def test_a_waiting_request_blocked_at_its_first_item_keeps_its_reference() -> None:
    scheduler, runner = _setup()
    scheduler.add_request(_req("img", [("a", 0, 16)], 24))
    out, _ = run_step(scheduler, runner)
    assert out.total_num_scheduled_tokens == 0 and "img" in out.remote_encoder_inputs
    for _ in range(5):
        out, _ = run_step(scheduler, runner)
        assert out.total_num_scheduled_tokens == 0 and not out.free_encoder_identifiers
        assert scheduler.encoder_cache_manager.cached["a"] == {"img"}
        assert scheduler.requests["img"].status == RequestStatus.WAITING
    assert runner.num_remote_sent == 1 and not runner.cancelled
    runner.deliver = {"a"}
    for _ in range(8):
        run_step(scheduler, runner)
    _assert_all_free(scheduler)


def test_abort_of_the_last_holder_cancels_the_item_and_a_late_reply_is_dropped() -> None:
    scheduler, runner = _setup()
    scheduler.add_request(_req("r1", [("shared", 4, 16)], 30))
    scheduler.add_request(_req("r2", [("shared", 6, 16)], 30))
    run_step(scheduler, runner)
    run_step(scheduler, runner)
    assert scheduler.encoder_cache_manager.cached["shared"] == {"r1", "r2"}
    scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    out, _ = run_step(scheduler, runner)
    assert "shared" not in out.free_encoder_identifiers  # r2 still waits for it
    scheduler.finish_requests("r2", RequestStatus.FINISHED_ABORTED)
    runner.deliver = {"shared"}  # the reply comes after the cancel
    out, _ = run_step(scheduler, runner)
    assert out.free_encoder_identifiers == ["shared"] and runner.cancelled == ["shared"]
    assert "shared" not in runner.encoder_cache
    _assert_all_free(scheduler)
    # a late arrival report for a cancelled item is ignored by the ledger
    assert not scheduler.encoder_cache_manager.mark_arrived("shared")
    scheduler.check_integrity()


def test_preemption_of_the_holder_cancels_the_item_and_it_is_sent_again_on_resume() -> None:
    scheduler, runner = _setup(num_blocks=6, block_size=4)
    scheduler.add_request(make_request("text", 8, max_tokens=14, ignore_eos=True))
    scheduler.add_request(_req("img", [("a", 8, 4)], 14, max_tokens=1))
    preempted = False
    for _ in range(60):
        out, _ = run_step(scheduler, runner)
        if "img" in out.preempted_req_ids:
            preempted = True
            assert scheduler.encoder_cache_manager.cached.get("a") is None
        if preempted and not scheduler.requests.get("img"):
            break
        if preempted and runner.remote_pending:
            runner.deliver = set(runner.remote_pending)
        if not scheduler.requests:
            break
    assert preempted and runner.cancelled == ["a"] and runner.num_remote_sent == 2
    for _ in range(30):
        if not scheduler.requests:
            break
        run_step(scheduler, runner)
    _assert_all_free(scheduler)


def test_a_failed_item_fails_exactly_its_holders_and_others_finish() -> None:
    scheduler, runner = _setup()
    scheduler.add_request(_req("r1", [("bad", 4, 16)], 30))
    scheduler.add_request(_req("r2", [("bad", 2, 16)], 30))
    scheduler.add_request(_req("ok", [("good", 4, 16)], 30))
    scheduler.add_request(make_request("text", 8, max_tokens=3, ignore_eos=True))
    run_step(scheduler, runner)
    failure = RequestFailure("no encoder could encode image item 0", FailureKind.UNAVAILABLE)
    runner.fail_items = {"bad": failure}
    runner.deliver = {"good"}
    _, updates = run_step(scheduler, runner)
    errors = {u.request_id: u.error for u in updates if u.error is not None}
    assert errors == {"r1": failure, "r2": failure}
    finished = {}
    for _ in range(30):
        for u in run_step(scheduler, runner)[1]:
            if u.finished:
                finished[u.request_id] = u.finish_status
    assert finished == {"ok": RequestStatus.FINISHED_LENGTH, "text": RequestStatus.FINISHED_LENGTH}
    assert not runner.cancelled
    _assert_all_free(scheduler)


def test_in_flight_items_are_never_evicted_and_reserve_their_bytes() -> None:
    # room for one 16-embedding item: the second request waits for the space, not evicting
    scheduler, runner = _setup(encoder_cache_size=16, max_tokens_per_mm_item=16)
    scheduler.add_request(_req("r1", [("a", 4, 16)], 30))
    scheduler.add_request(_req("r2", [("b", 4, 16)], 30))
    out, _ = run_step(scheduler, runner)
    assert list(out.remote_encoder_inputs) == ["r1"] and out.num_scheduled_tokens["r2"] == 4
    for _ in range(3):
        out, _ = run_step(scheduler, runner)
        assert not out.remote_encoder_inputs and not out.free_encoder_identifiers
    runner.deliver = {"a"}
    sent_b = False
    for _ in range(40):
        out, _ = run_step(scheduler, runner)
        sent_b |= "r2" in out.remote_encoder_inputs
        runner.deliver |= set(runner.remote_pending)
        if not scheduler.requests:
            break
    assert sent_b
    _assert_all_free(scheduler)


def test_random_arrivals_failures_aborts_and_preemptions_keep_the_books() -> None:
    import random

    rng = random.Random(16)
    scheduler, runner = _setup(
        num_blocks=24, block_size=4, max_num_batched_tokens=24, encoder_cache_size=40,
        max_tokens_per_mm_item=16,
    )  # fmt: skip
    failure = RequestFailure("no encoder could encode it", FailureKind.UNAVAILABLE)
    outcomes: dict[str, str] = {}
    for step_idx in range(3000):
        if step_idx < 300 and rng.random() < 0.5:
            rid = f"r{step_idx}"
            images = [(f"img{rng.randrange(8)}", 3, rng.choice([4, 8, 16]))]
            if rng.random() < 0.5:
                images.append((f"img{rng.randrange(8)}", 22, 4))
            scheduler.add_request(_req(rid, images, 30, max_tokens=rng.randrange(1, 12)))
        for identifier in list(runner.remote_pending):
            roll = rng.random()
            if roll < 0.3:
                runner.deliver.add(identifier)
            elif roll < 0.33:
                runner.fail_items[identifier] = failure
        if scheduler.requests and rng.random() < 0.05:
            scheduler.finish_requests(
                rng.choice(sorted(scheduler.requests)), RequestStatus.FINISHED_ABORTED
            )
            scheduler.check_integrity()
        _, updates = run_step(scheduler, runner)
        for u in updates:
            if u.finished:
                outcomes[u.request_id] = "error" if u.error is not None else "done"
        if step_idx >= 300 and not scheduler.requests:
            break
    assert not scheduler.requests, "a request waited forever"
    assert "error" in outcomes.values() and "done" in outcomes.values()
    assert scheduler.num_preemptions > 0 and runner.cancelled
    _assert_all_free(scheduler)
