"""Prefix-cache keys: images, in-block offsets and salts separate KV; reuse never covers the
last prompt token; digests are full width."""

from __future__ import annotations

import pytest

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.hashing import Hasher
from mmserve.scheduling import KVCacheManager, Scheduler
from mmserve.scheduling.kv_cache_manager import hash_block
from tests.support.fake_runner import FakeRunner, make_request, make_scheduler, run_step

BS = 16


def _scheduler(enable_prefix_caching: bool = True, algorithm: str = "blake3") -> Scheduler:
    return make_scheduler(
        SchedulerConfig(max_model_len=512, max_num_batched_tokens=256),
        CacheConfig(
            num_blocks=64,
            block_size=BS,
            enable_prefix_caching=enable_prefix_caching,
            hash_algorithm=algorithm,
        ),
    )


def _run_alone(scheduler: Scheduler, runner: FakeRunner, request) -> tuple[int, list[int]]:
    """Run one request to completion; returns (prefix-hit tokens, items encoded at admission)."""
    scheduler.add_request(request)
    out, _ = run_step(scheduler, runner)
    (new,) = out.scheduled_new_reqs
    encoded = out.scheduled_encoder_inputs.get(request.request_id, [])
    while scheduler.has_unfinished_requests():
        run_step(scheduler, runner)
    return new.num_computed_tokens, encoded


def _pair(scheduler: Scheduler, first, second) -> int:
    runner = FakeRunner(scheduler.scheduler_config.effective_encoder_cache_size, BS)
    _run_alone(scheduler, runner, first)
    hit, _ = _run_alone(scheduler, runner, second)
    return hit


def test_same_prompt_and_image_reuses_full_blocks_but_never_the_last_token():
    scheduler = _scheduler()
    # 64 tokens = 4 full blocks: everything is cached, so one block is backed off.
    hit = _pair(
        scheduler,
        make_request("a", 64, [("img-x", 8, 40)], max_tokens=1),
        make_request("b", 64, [("img-x", 8, 40)], max_tokens=1),
    )
    assert hit == 48
    # 70 tokens: 4 full blocks hit, the tail (with the last token) is recomputed.
    hit = _pair(
        scheduler,
        make_request("c", 70, [("img-y", 8, 40)], max_tokens=1),
        make_request("d", 70, [("img-y", 8, 40)], max_tokens=1),
    )
    assert hit == 64
    stats = scheduler.make_stats()
    assert stats.prefix_cache_queries == 64 + 64 + 70 + 70
    assert stats.prefix_cache_hits == 48 + 64


def test_different_images_same_size_never_share_a_block():
    a = make_request("a", 80, [("img-a", 8, 40)], max_tokens=1)
    b = make_request("b", 80, [("img-b", 8, 40)], max_tokens=1)
    assert a.prompt_token_ids == b.prompt_token_ids  # placeholders alone cannot tell them apart
    scheduler = _scheduler()
    assert _pair(scheduler, a, b) == 0
    assert not set(a.block_hashes) & set(b.block_hashes)
    assert len(a.block_hashes) == 5


def test_text_block_before_the_image_is_shared_image_blocks_are_not():
    # Image starts in block 1; block 0 is plain text and is the same in both.
    a = make_request("a", 80, [("img-a", 20, 40)], max_tokens=1)
    b = make_request("b", 80, [("img-b", 20, 40)], max_tokens=1)
    assert _pair(_scheduler(), a, b) == 16
    assert a.block_hashes[0] == b.block_hashes[0]
    assert not set(a.block_hashes[1:]) & set(b.block_hashes[1:])


def test_same_image_one_token_later_never_shares_image_blocks():
    a = make_request("a", 80, [("img-x", 20, 40)], max_tokens=1)
    b = make_request("b", 81, [("img-x", 21, 40)], max_tokens=1)
    assert _pair(_scheduler(), a, b) == 16  # only the text block before the image
    assert not set(a.block_hashes[1:]) & set(b.block_hashes)


def test_in_block_offset_is_part_of_the_key():
    # Same parent, same (all-placeholder) tokens, same image: only the offset differs.
    hasher = Hasher("blake3")
    tokens = [151655] * BS
    at_0 = hash_block(hasher, "parent", tokens, [("img-x", 0)], None)
    at_minus_3 = hash_block(hasher, "parent", tokens, [("img-x", -3)], None)
    assert at_0 != at_minus_3
    assert at_0 == hash_block(hasher, "parent", tokens, [("img-x", 0)], None)


def test_cache_salt_separates_every_block():
    def req(rid: str, salt: str | None):
        return make_request(rid, 80, [("img-x", 20, 40)], max_tokens=1, cache_salt=salt)

    scheduler = _scheduler()
    runner = FakeRunner(scheduler.scheduler_config.effective_encoder_cache_size, BS)
    plain, salted, other, same = (
        req("p", None),
        req("s", "tenant-1"),
        req("o", "t2"),
        req("t", "tenant-1"),
    )
    assert _run_alone(scheduler, runner, plain)[0] == 0
    assert _run_alone(scheduler, runner, salted)[0] == 0
    assert _run_alone(scheduler, runner, other)[0] == 0
    assert _run_alone(scheduler, runner, same)[0] == 64
    assert not set(plain.block_hashes) & set(salted.block_hashes)
    assert not set(salted.block_hashes) & set(other.block_hashes)
    empty_salt = req("e", "")
    KVCacheManager(CacheConfig(num_blocks=8)).update_block_hashes(empty_salt)
    assert not set(empty_salt.block_hashes) & set(plain.block_hashes)


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_block_hashes_are_full_width(algorithm):
    request = make_request("a", 48, [("img-x", 4, 20)])
    KVCacheManager(CacheConfig(num_blocks=8, hash_algorithm=algorithm)).update_block_hashes(request)
    assert len(request.block_hashes) == 3
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in request.block_hashes)


def test_disabled_prefix_caching_never_reuses():
    scheduler = _scheduler(enable_prefix_caching=False)
    a = make_request("a", 64, [("img-x", 8, 40)], max_tokens=1)
    b = make_request("b", 64, [("img-x", 8, 40)], max_tokens=1)
    assert _pair(scheduler, a, b) == 0
    assert a.block_hashes == [] and b.block_hashes == []
    assert scheduler.make_stats().prefix_cache_queries == 0


def test_image_inside_the_hit_is_not_encoded_and_straddling_image_is():
    scheduler = _scheduler()
    runner = FakeRunner(scheduler.scheduler_config.effective_encoder_cache_size, BS)
    # Blocks of 16: X [4, 20) lies inside a 48-token hit, Y [28, 60) straddles its end.
    images = [("img-x", 4, 16), ("img-y", 28, 32)]
    _run_alone(scheduler, runner, make_request("a", 70, images, max_tokens=1))
    # Make room for a cache-sized item: both outputs are evicted (logically, then physically).
    big = make_request("z", 256, [("img-z", 0, 256)])
    assert scheduler.encoder_cache_manager.can_allocate(big, 0, 4 * 256, 0)  # patches
    assert not scheduler.encoder_cache_manager.cached
    b = make_request("b", 70, images, max_tokens=1)
    b.prompt_token_ids[62] = 5  # diverge in block 3: blocks 0-2 hit
    hit, encoded = _run_alone(scheduler, runner, b)
    assert hit == 48
    assert encoded == [1]  # Y is encoded whole; X, inside the computed prefix, is not
    assert runner.num_items_encoded == 3


def test_a_request_sharing_blocks_computed_this_step_waits_one_step_and_hits():
    scheduler, runner = _scheduler(), FakeRunner(8192, BS)
    first = make_request("first", 70, [("img-a", 5, 40)], max_tokens=2)
    same = make_request("same", 70, [("img-a", 5, 40)], max_tokens=2)
    other = make_request("other", 70, [("img-b", 5, 40)], text_seed=3, max_tokens=2)
    for r in (first, same, other):
        scheduler.add_request(r)
    out, _ = run_step(scheduler, runner)
    # "same" shares its first block with "first", which computes it in this very step: it is
    # deferred (not blocking "other" behind it) instead of recomputing the prefix and image.
    assert set(out.num_scheduled_tokens) == {"first", "other"}
    out, _ = run_step(scheduler, runner)
    (new,) = out.scheduled_new_reqs
    assert new.request_id == "same" and new.num_computed_tokens == 64  # 4 full blocks hit
    assert "same" not in out.scheduled_encoder_inputs  # the image is inside the hit
    while scheduler.has_unfinished_requests():
        run_step(scheduler, runner)
    scheduler.check_integrity()
