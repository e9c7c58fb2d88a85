"""Processor cache and UUID index: LRU bounded by what entries really hold, exact accounting."""

from __future__ import annotations

import sys
import tracemalloc

import numpy as np
import pytest

from mmserve.multimodal import EncoderInput
from mmserve.processing.image_processor import ImageProcessorConfig, process_image
from mmserve.processing.processor_cache import (
    CACHE_ENTRY_OVERHEAD_BYTES,
    ProcessorCache,
    UUIDIndex,
    UUIDRecord,
    cache_entry_bytes,
)
from tests.support.factory import CLIP_NORMALIZATION as NORM
from tests.support.factory import random_image


def _item(num_patches: int) -> EncoderInput:
    return EncoderInput(np.zeros((num_patches, 6), dtype=np.uint8), (1, 1, num_patches), NORM)


def _cost(num_patches: int, key: str = "a") -> int:
    return cache_entry_bytes(key, _item(num_patches))


def test_lru_evicts_least_recent_by_bytes_and_counts_hits() -> None:
    cache = ProcessorCache(capacity_bytes=3 * _cost(1))  # room for three one-patch entries
    for key in "abc":
        cache.put(key, _item(1))
    assert cache.get("a") is not None  # a is now most recent
    cache.put("d", _item(1))  # evicts b
    assert "b" not in cache and "a" in cache and "d" in cache
    assert cache.get("b") is None
    assert (cache.stats.queries, cache.stats.hits) == (2, 1)
    cache.check_integrity()


def test_big_item_evicts_as_many_as_needed_and_oversized_items_are_skipped() -> None:
    cache = ProcessorCache(capacity_bytes=4 * _cost(1))
    for key in "abcd":
        cache.put(key, _item(1))
    assert _cost(1) < _cost(30, "big") <= 2 * _cost(1)  # needs the room of two small entries
    cache.put("big", _item(30))
    assert "big" in cache and "d" in cache and "c" in cache and "b" not in cache
    cache.put("huge", _item(1000))
    assert "huge" not in cache
    cache.check_integrity()


def test_an_entry_costs_its_whole_buffer_key_and_overhead() -> None:
    base = np.zeros((100, 6), dtype=np.uint8)  # 600 bytes
    view = EncoderInput(base[:2], (1, 1, 2), NORM)  # 12 bytes of its own, keeps 600 alive
    key = "k" * 64
    assert view.nbytes == 12 and view.buffer_bytes == 600
    assert cache_entry_bytes(key, view) == 600 + sys.getsizeof(key) + CACHE_ENTRY_OVERHEAD_BYTES
    cache = ProcessorCache(capacity_bytes=cache_entry_bytes(key, view) - 1)
    cache.put(key, view)
    assert key not in cache  # counted by what it holds, it does not fit


def test_counted_cost_covers_the_memory_entries_really_hold() -> None:
    """tracemalloc sees every Python and numpy allocation: the budget must not undercount."""
    num = 2000
    keys = [f"{i:064x}" for i in range(num)]
    cache = ProcessorCache(capacity_bytes=1 << 30)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for key in keys:
            out = np.empty((4, 3, 2, 4), dtype=np.uint8)  # processed shape, then a view of it
            cache.put(key, EncoderInput(out.reshape(4, 24), (1, 2, 2), NORM))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    key_bytes = sum(sys.getsizeof(k) for k in keys)  # the keys existed before; entries keep them
    assert cache.used_bytes >= held + key_bytes * 0.9
    assert cache.used_bytes <= 2 * (held + key_bytes)  # and not wildly over either


def test_randomised_operations_keep_the_byte_count_exact() -> None:
    rng = np.random.default_rng(0)
    cache = ProcessorCache(capacity_bytes=8 * _cost(10))
    for _ in range(500):
        k = int(rng.integers(0, 30))
        key = str(k) * (1 + k)  # keys of many lengths
        op = rng.random()
        if op < 0.5:
            data = np.zeros((int(rng.integers(1, 60)), 6), dtype=np.uint8)
            view = data[: int(rng.integers(1, len(data) + 1))]  # sometimes a view of more
            cache.put(key, EncoderInput(view, (1, 1, len(view)), NORM))
        else:
            cache.get(key)
        cache.check_integrity()
    assert len(cache) > 0 and cache.stats.hits > 0


def test_zero_gb_disables_the_cache() -> None:
    cache = ProcessorCache.from_gb(0)
    cache.put("a", _item(1))
    assert cache.get("a") is None and not cache.enabled
    assert cache.stats.queries == 1 and cache.stats.hits == 0
    with pytest.raises(ValueError, match="mm-processor-cache-gb"):
        ProcessorCache.from_gb(-1)


REC = UUIDRecord(10, 20, "RGB")


def test_uuid_index_is_lru_and_namespaced() -> None:
    index = UUIDIndex(capacity_bytes=2 * UUIDIndex.entry_bytes("k1", "u"))
    index.remember("k1", "u", REC)
    index.remember("k2", "u", REC)
    assert index.lookup("k1", "u") == REC  # refreshes k1/u
    index.remember("k1", "v", REC)  # evicts k2/u
    assert index.lookup("k2", "u") is None and len(index) == 2
    assert index.lookup("k1", "v") == REC
    index.check_integrity()


def test_long_uuids_spend_the_byte_budget() -> None:
    budget = 64 * 1024
    index = UUIDIndex(capacity_bytes=budget)
    for i in range(200):
        index.remember("default", f"{i}-" + "x" * 1000, REC)  # ~1 KiB keys
        index.check_integrity()
    assert index.used_bytes <= budget
    assert len(index) < budget // 1000  # an entry count alone would have kept all 200
    assert index.lookup("default", "199-" + "x" * 1000) == REC  # the newest survive
    assert index.lookup("default", "0-" + "x" * 1000) is None
    index.remember("default", "y" * budget, REC)  # larger than the whole budget: not kept
    assert index.lookup("default", "y" * budget) is None
    index.check_integrity()


def test_uuid_index_randomised_accounting() -> None:
    rng = np.random.default_rng(1)
    index = UUIDIndex(capacity_bytes=8 * 1024)
    for _ in range(400):
        ns = ("default", "key-0123456789abcdef")[int(rng.integers(0, 2))]
        uuid = "u" * int(rng.integers(1, 300)) + str(int(rng.integers(0, 5)))
        if rng.random() < 0.6:
            index.remember(ns, uuid, UUIDRecord(int(rng.integers(1, 99)), 1, "L"))
        else:
            index.lookup(ns, uuid)
        index.check_integrity()


def test_a_processed_image_costs_one_byte_per_patch_value() -> None:
    """uint8 levels: a 448x448 image holds 1024 x 1176 bytes, a quarter of its float32 values."""
    image = process_image(random_image(448, 448, seed=2), ImageProcessorConfig())
    key = "i" * 64
    assert image.buffer_bytes == 1024 * 1176 == image.normalized().nbytes // 4
    cost = cache_entry_bytes(key, image)
    assert cost == 1024 * 1176 + sys.getsizeof(key) + CACHE_ENTRY_OVERHEAD_BYTES
    cache = ProcessorCache(capacity_bytes=4 * cost)
    for k in "abcd":  # four fit where one float32 image would have
        cache.put(
            k * 64, process_image(random_image(448, 448, seed=ord(k)), ImageProcessorConfig())
        )
    assert len(cache) == 4
    cache.check_integrity()
