"""The byte-budget LRU: eviction order, the budget, expiry, integrity after every operation."""

from __future__ import annotations

import random

from mmserve.disaggregation.embedding_cache import ByteBudgetLRU


def test_least_recently_used_goes_first_and_the_budget_holds() -> None:
    lru: ByteBudgetLRU[str] = ByteBudgetLRU(100)
    assert lru.put("a", "A", 40) and lru.put("b", "B", 40)
    assert lru.get("a") == "A"  # a is now the most recent
    assert lru.put("c", "C", 40)  # evicts b
    assert lru.get("b") is None and lru.get("a") == "A" and lru.get("c") == "C"
    assert not lru.put("huge", "H", 101)  # over the whole budget: not stored, nothing evicted
    assert len(lru) == 2 and lru.num_bytes == 80
    lru.check_integrity()


def test_entries_expire_after_their_ttl() -> None:
    now = [0.0]
    lru: ByteBudgetLRU[bytes] = ByteBudgetLRU(10, ttl_s=5, clock=lambda: now[0])
    lru.put("k", b"v", 1)
    now[0] = 4.0
    assert lru.get("k") == b"v"
    now[0] = 9.5
    assert lru.get("k") is None and lru.num_bytes == 0


def test_random_operations_keep_the_ledger_exact() -> None:
    rng = random.Random(0)
    lru: ByteBudgetLRU[int] = ByteBudgetLRU(1000)
    for step in range(2000):
        key = str(rng.randrange(50))
        if rng.random() < 0.6:
            lru.put(key, step, rng.randrange(0, 300))
        else:
            lru.get(key)
        lru.check_integrity()
