"""Processor cache: byte-bounded LRU with counters; the bounded UUID index."""

from __future__ import annotations

import numpy as np
import pytest

from mmserve.multimodal import ProcessedImage
from mmserve.processing.processor_cache import ProcessorCache, UUIDIndex, UUIDRecord


def _item(num_patches: int) -> ProcessedImage:
    return ProcessedImage(np.zeros((num_patches, 4), dtype=np.float32), (1, 1, num_patches))


def test_lru_evicts_least_recent_by_bytes_and_counts_hits() -> None:
    cache = ProcessorCache(capacity_bytes=3 * 16)  # three 16-byte items
    for key in "abc":
        cache.put(key, _item(1))
    assert cache.get("a") is not None  # a is now most recent
    cache.put("d", _item(1))  # evicts b
    assert "b" not in cache and "a" in cache and "d" in cache
    assert cache.get("b") is None
    assert (cache.stats.queries, cache.stats.hits) == (2, 1)
    cache.check_integrity()


def test_big_item_evicts_as_many_as_needed_and_oversized_items_are_skipped() -> None:
    cache = ProcessorCache(capacity_bytes=4 * 16)
    for key in "abcd":
        cache.put(key, _item(1))
    cache.put("big", _item(3))
    assert len(cache) == 2 and "big" in cache and "d" in cache
    cache.put("huge", _item(5))
    assert "huge" not in cache and cache.used_bytes == 4 * 16
    cache.check_integrity()


def test_randomised_operations_keep_the_byte_count_exact() -> None:
    rng = np.random.default_rng(0)
    cache = ProcessorCache(capacity_bytes=1000)
    for _ in range(500):
        key = str(int(rng.integers(0, 30)))
        if rng.random() < 0.5:
            cache.put(key, _item(int(rng.integers(1, 20))))
        else:
            cache.get(key)
        cache.check_integrity()


def test_zero_gb_disables_the_cache() -> None:
    cache = ProcessorCache.from_gb(0)
    cache.put("a", _item(1))
    assert cache.get("a") is None and not cache.enabled
    assert cache.stats.queries == 1 and cache.stats.hits == 0
    with pytest.raises(ValueError, match="mm-processor-cache-gb"):
        ProcessorCache.from_gb(-1)


def test_uuid_index_is_bounded_and_namespaced() -> None:
    index = UUIDIndex(max_entries=2)
    rec = UUIDRecord(10, 20, "RGB")
    index.remember("k1", "u", rec)
    index.remember("k2", "u", rec)
    assert index.lookup("k1", "u") == rec  # refreshes k1/u
    index.remember("k1", "v", rec)  # evicts k2/u
    assert index.lookup("k2", "u") is None and len(index) == 2
