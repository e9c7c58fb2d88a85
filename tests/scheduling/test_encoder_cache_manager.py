"""Encoder cache manager: a byte ledger, references, resident-but-freeable entries, lazy LRU
eviction. The fake items have 4 input patches per embedding."""

from __future__ import annotations

import random

from mmserve.scheduling import EncoderCacheManager
from tests.support.fake_runner import make_request


def _img_request(rid: str, identifier: str, num_embeds: int = 1369):
    return make_request(rid, num_embeds + 10, [(identifier, 5, num_embeds)])


EMBED_BYTES = 3584 * 2  # Qwen2-VL-7B: hidden size x bf16


def test_five_1369_token_images_fill_8192_embeddings_and_a_sixth_waits_until_one_finishes():
    manager = EncoderCacheManager(8192 * EMBED_BYTES, bytes_per_embed=EMBED_BYTES)
    budget = 8192 * 4
    running = [_img_request(f"r{i}", f"img-{i}") for i in range(5)]
    for request in running:
        assert not manager.check_and_update_cache(request, 0)
        assert manager.can_allocate(request, 0, patch_budget=budget, num_bytes_to_schedule=0)
        manager.allocate(request, 0)
        manager.check_integrity()
    assert manager.num_free_bytes == (8192 - 5 * 1369) * EMBED_BYTES
    assert manager.num_used_slots == 5 * 1369
    sixth = _img_request("r5", "img-5")
    # Every resident entry is referenced: nothing can be evicted.
    assert not manager.can_allocate(sixth, 0, patch_budget=budget, num_bytes_to_schedule=0)
    assert manager.get_freed_identifiers() == []
    manager.free(running[1])  # r1 finishes: its entry stays resident, now freeable
    assert "img-1" in manager.cached and manager.num_free_bytes == 1347 * EMBED_BYTES
    assert manager.can_allocate(sixth, 0, patch_budget=budget, num_bytes_to_schedule=0)
    manager.allocate(sixth, 0)
    manager.check_integrity()
    assert manager.get_freed_identifiers() == ["img-1"]
    assert manager.get_freed_identifiers() == []  # drained once
    assert manager.num_used_bytes == 5 * 1369 * EMBED_BYTES


def test_finished_entry_stays_resident_and_gives_a_later_hit():
    manager = EncoderCacheManager(4000)
    first = _img_request("a", "img-x")
    assert manager.can_allocate(first, 0, 4 * 4000, 0)
    manager.allocate(first, 0)
    manager.free(first)
    assert manager.freeable == {"img-x": 1369}
    later = _img_request("b", "img-x")
    assert manager.check_and_update_cache(later, 0)
    assert manager.freeable == {} and manager.cached["img-x"] == {"b"}
    assert manager.num_freeable_bytes == 4000 - 1369
    assert (manager.queries, manager.hits) == (2, 1)
    assert manager.check_and_update_cache(later, 0)  # a holder looking again is no new query
    assert (manager.queries, manager.hits) == (2, 1)
    manager.check_integrity()


def test_patch_budget_is_checked_before_space_and_eviction_is_oldest_first():
    manager = EncoderCacheManager(3000 * 2, bytes_per_embed=2)
    for rid, ident in (("a", "old"), ("b", "new")):
        request = _img_request(rid, ident, 1000)
        assert manager.can_allocate(request, 0, 4000, 0)
        manager.allocate(request, 0)
        manager.free(request)
    big = _img_request("c", "big", 2500)  # 10,000 input patches, 5,000 bytes
    assert not manager.can_allocate(big, 0, patch_budget=9999, num_bytes_to_schedule=0)
    assert manager.freed == []  # a budget refusal evicts nothing
    assert manager.can_allocate(big, 0, patch_budget=10_000, num_bytes_to_schedule=0)
    assert manager.get_freed_identifiers() == ["old", "new"]
    # Bytes promised earlier in the same step count against the space.
    small = _img_request("d", "small", 600)
    assert not manager.can_allocate(small, 0, 10_000, num_bytes_to_schedule=5000)
    manager.check_integrity()


def test_randomized_operations_keep_the_books_consistent():
    rng = random.Random(0)
    manager = EncoderCacheManager(5000)
    live: dict[str, object] = {}
    sizes = [rng.randrange(1, 2500) for _ in range(12)]  # one identity, one size
    for step in range(2000):
        op = rng.random()
        if op < 0.5 or not live:
            k = rng.randrange(12)
            request = _img_request(f"r{step}", f"img-{k}", sizes[k])
            if manager.check_and_update_cache(request, 0) or (
                manager.can_allocate(request, 0, rng.randrange(1, 4 * 5000), 0)
                and manager.allocate(request, 0) is None
            ):
                live[request.request_id] = request
        else:
            manager.free(live.pop(rng.choice(sorted(live))))
        manager.check_integrity()
        manager.get_freed_identifiers()
    for request in live.values():
        manager.free(request)
    manager.check_integrity()
    assert manager.num_freeable_bytes == manager.capacity_bytes
    assert all(not holders for holders in manager.cached.values())
