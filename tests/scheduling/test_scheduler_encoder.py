"""Scheduler x encoder cache: the seed's scenarios, visible in the step outputs."""

from __future__ import annotations

import pytest

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.errors import EncoderItemTooLargeError, PromptTooLongError
from mmserve.scheduling import RequestStatus, Scheduler
from tests.support.fake_runner import FakeRunner, admit, make_request, make_scheduler, run_step


def _setup(**scheduler_kwargs) -> tuple[Scheduler, FakeRunner]:
    scheduler_kwargs.setdefault("max_model_len", 4096)
    scheduler_kwargs.setdefault("encoder_embed_bytes", 3584 * 2)  # Qwen2-VL-7B hidden x bf16
    # the fake items have 4 input patches per embedding, as Qwen2-VL's do
    scheduler_kwargs.setdefault(
        "max_patches_per_mm_item", 4 * scheduler_kwargs.get("max_tokens_per_mm_item", 0)
    )
    scheduler = make_scheduler(
        SchedulerConfig(**scheduler_kwargs), CacheConfig(num_blocks=1000, block_size=16)
    )
    runner = FakeRunner(scheduler.scheduler_config.effective_encoder_cache_size, 16)
    return scheduler, runner


def _img_req(rid: str, identifier: str, text_before: int, num_embeds: int, **kwargs):
    kwargs.setdefault("ignore_eos", True)
    kwargs.setdefault("max_tokens", 200)
    kwargs.setdefault("text_seed", sum(map(ord, rid)))  # no shared text prefix between requests
    return make_request(
        rid, text_before + num_embeds + 10, [(identifier, text_before, num_embeds)], **kwargs
    )


def test_8192_slot_cache_holds_five_1369_token_images_and_the_sixth_is_delayed_not_refused():
    scheduler, runner = _setup(max_num_batched_tokens=8192, max_tokens_per_mm_item=1369)
    assert scheduler.encoder_cache_manager.capacity_bytes == 8192 * 3584 * 2
    for i in range(6):
        scheduler.add_request(_img_req(f"r{i}", f"img-{i}", 10, 1369))

    out, _ = run_step(scheduler, runner)
    # Five images fit (6,845 slots); the sixth request runs only its text before the image.
    assert sorted(out.scheduled_encoder_inputs) == ["r0", "r1", "r2", "r3", "r4"]
    assert out.num_scheduled_tokens["r5"] == 10
    assert runner.last_step_encoded_embeds == 5 * 1369
    assert scheduler.encoder_cache_manager.num_free_bytes == 1347 * 3584 * 2
    stats = scheduler.make_stats()
    # After the step their images are consumed: resident (a later hit is free) but reclaimable.
    assert stats.encoder_cache_resident_slots == 6845
    assert stats.encoder_cache_used_slots == 0
    assert stats.encoder_cache_used_bytes == 0
    assert scheduler.encoder_cache_manager.num_used_bytes == 6845 * 3584 * 2
    assert (stats.num_running, stats.num_waiting) == (6, 0)

    # The five are decoding; their images are consumed, so they are resident but freeable.
    out, _ = run_step(scheduler, runner)
    assert out.scheduled_encoder_inputs == {"r5": [0]}
    assert out.free_encoder_identifiers == ["img-0"]  # LRU eviction reaches the runner
    assert "img-0" not in runner.encoder_cache and "img-5" in runner.encoder_cache
    assert all(out.num_scheduled_tokens[f"r{i}"] == 1 for i in range(5))

    # A finished request's image stays resident: a later request with it is a free hit.
    scheduler.finish_requests("r3", RequestStatus.FINISHED_ABORTED)
    hits_before = scheduler.make_stats().encoder_cache_hits
    scheduler.add_request(_img_req("r6", "img-3", 4, 1369))
    out, _ = run_step(scheduler, runner)
    assert "r3" in out.finished_req_ids
    assert out.num_scheduled_tokens["r6"] == 4 + 1369 + 10
    assert "r6" not in out.scheduled_encoder_inputs
    assert scheduler.make_stats().encoder_cache_hits == hits_before + 1
    assert runner.num_items_encoded == 6


def test_two_step_rule_text_up_to_the_item_then_zero_tokens_then_proceed():
    # Cache 2000 slots. A holds P (1000) mid-prefill; B's Y (1500) cannot fit; C takes X (1000).
    scheduler, runner = _setup(
        max_num_batched_tokens=800, max_tokens_per_mm_item=1500, encoder_cache_size=2000
    )
    scheduler.add_request(_img_req("a", "img-p", 10, 1000))
    scheduler.add_request(_img_req("b", "img-y", 20, 1500))
    scheduler.add_request(_img_req("c", "img-x", 300, 1000))

    out, _ = run_step(scheduler, runner)  # A's chunk cuts through P
    assert out.num_scheduled_tokens == {"a": 800} and out.scheduled_encoder_inputs == {"a": [0]}

    out, _ = run_step(scheduler, runner)
    assert out.num_scheduled_tokens == {"a": 220, "b": 20, "c": 560}  # B: text up to Y
    assert out.scheduled_encoder_inputs == {"c": [0]}

    out, _ = run_step(scheduler, runner)
    assert "b" not in out.num_scheduled_tokens  # B stands at Y: zero tokens this step
    assert out.num_scheduled_tokens == {"a": 1, "c": 750}  # the others go on

    out, _ = run_step(scheduler, runner)
    assert out.scheduled_encoder_inputs == {"b": [0]}
    assert out.free_encoder_identifiers == ["img-p", "img-x"]
    assert out.num_scheduled_tokens == {"a": 1, "b": 799}  # C's decode waits for budget


def test_same_image_in_two_requests_of_one_step_is_encoded_once():
    scheduler, runner = _setup(max_num_batched_tokens=4096)
    scheduler.add_request(_img_req("a", "img-x", 5, 300, max_tokens=3))
    scheduler.add_request(_img_req("b", "img-x", 17, 300, max_tokens=3))
    twice = make_request("c", 700, [("img-x", 10, 300), ("img-x", 350, 300)], max_tokens=3)
    scheduler.add_request(twice)
    out, _ = run_step(scheduler, runner)
    assert out.scheduled_encoder_inputs == {"a": [0]}
    assert runner.num_items_encoded == 1
    while scheduler.has_unfinished_requests():
        run_step(scheduler, runner)
    stats = scheduler.make_stats()
    assert (stats.encoder_cache_queries, stats.encoder_cache_hits) == (3, 2)
    assert stats.encoder_cache_resident_slots == 300
    assert stats.encoder_cache_used_slots == 0


def test_chunks_cut_through_an_image_encoded_once_then_sliced():
    scheduler, runner = _setup(max_num_batched_tokens=64, max_tokens_per_mm_item=100)
    scheduler.add_request(_img_req("a", "img-x", 10, 100, max_tokens=1))
    windows = []
    while scheduler.has_unfinished_requests():
        out, _ = run_step(scheduler, runner)
        windows.append((out.num_scheduled_tokens["a"], out.scheduled_encoder_inputs))
    assert windows == [(64, {"a": [0]}), (56, {})]
    assert runner.num_items_encoded == 1


def test_disable_chunked_mm_input_rolls_back_to_before_the_item():
    scheduler, runner = _setup(
        max_num_batched_tokens=64, max_tokens_per_mm_item=50, disable_chunked_mm_input=True
    )
    scheduler.add_request(_img_req("a", "img-x", 30, 50, max_tokens=1))
    out, _ = run_step(scheduler, runner)
    assert out.num_scheduled_tokens == {"a": 30} and not out.scheduled_encoder_inputs
    out, _ = run_step(scheduler, runner)
    assert out.num_scheduled_tokens == {"a": 60} and out.scheduled_encoder_inputs == {"a": [0]}


def test_disable_chunked_mm_input_refuses_configs_and_items_that_can_never_fit_a_step():
    with pytest.raises(ValueError, match="max-num-batched-tokens"):
        SchedulerConfig(
            max_model_len=4096,
            max_num_batched_tokens=64,
            max_tokens_per_mm_item=100,
            disable_chunked_mm_input=True,
        )
    scheduler, _ = _setup(
        max_num_batched_tokens=64, disable_chunked_mm_input=True, encoder_patch_budget=1000
    )
    with pytest.raises(EncoderItemTooLargeError, match="disable-chunked-mm-input"):
        admit(scheduler, _img_req("a", "img-x", 0, 65))
    assert not scheduler.has_unfinished_requests()


def test_item_larger_than_the_encoder_cache_is_refused_not_left_waiting():
    scheduler, _ = _setup(
        max_num_batched_tokens=2048, max_tokens_per_mm_item=1369, encoder_patch_budget=10**6
    )
    with pytest.raises(EncoderItemTooLargeError) as refused:
        admit(scheduler, _img_req("a", "img-4k", 0, 2049))
    message = str(refused.value)
    assert "image 1 of the prompt" in message and "--encoder-cache-bytes" in message
    assert f"{2049 * 3584 * 2} bytes" in message and f"holds {2048 * 3584 * 2} bytes" in message
    assert refused.value.param == "messages"
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        admit(scheduler, make_request("b", 4097))
    assert scheduler.get_num_unfinished_requests() == 0


def test_item_over_the_patch_budget_is_refused_naming_the_flag_and_delayed_when_it_fits_alone():
    """The per-step budget counts input patches: 4 per embedding of the fake items."""
    scheduler, runner = _setup(
        max_num_batched_tokens=512, encoder_patch_budget=1000, max_patches_per_mm_item=800
    )
    assert scheduler.scheduler_config.effective_encoder_patch_budget == 1000
    with pytest.raises(EncoderItemTooLargeError) as refused:
        admit(
            scheduler,
            make_request("big", 300, [("img-a", 0, 10), ("img-b", 20, 251)], max_tokens=1),
        )
    message = str(refused.value)
    assert "image 2 of the prompt is 1004 input patches" in message
    assert "at most 1000 per step" in message and "--encoder-patch-budget" in message
    # 200 embeddings = 800 patches each: two cannot share a step, so the second waits.
    scheduler.add_request(_img_req("a", "img-a", 4, 200, max_tokens=1))
    scheduler.add_request(_img_req("b", "img-b", 4, 200, max_tokens=1))
    out, _ = run_step(scheduler, runner)
    assert out.scheduled_encoder_inputs == {"a": [0]} and out.num_scheduled_tokens["b"] == 4
    out, _ = run_step(scheduler, runner)
    assert out.scheduled_encoder_inputs == {"b": [0]}


def test_budget_floors_cover_the_largest_item_of_every_modality():
    config = SchedulerConfig(
        max_model_len=4096,
        max_num_batched_tokens=64,
        max_tokens_per_mm_item=3000,  # e.g. a maximal video
        max_patches_per_mm_item=12000,
        encoder_cache_size=16,
        encoder_patch_budget=32,
        encoder_embed_bytes=128,
    )
    assert config.effective_encoder_patch_budget == 12000
    assert config.effective_encoder_cache_bytes == 3000 * 128
    assert config.effective_encoder_cache_size == 3000
    by_bytes = SchedulerConfig(max_model_len=64, encoder_cache_bytes=1000, encoder_embed_bytes=64)
    assert (by_bytes.effective_encoder_cache_bytes, by_bytes.effective_encoder_cache_size) == (
        1000,
        15,
    )
    with pytest.raises(ValueError, match="give only one"):
        SchedulerConfig(max_model_len=64, encoder_cache_size=8, encoder_cache_bytes=1000)
