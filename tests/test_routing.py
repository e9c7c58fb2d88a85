"""Rendezvous hashing bounded by load (mmserve/routing.py)."""

from __future__ import annotations

import pytest

from mmserve.routing import AFFINITY_SLACK, choose_bounded, rendezvous_order

NODES = ["tcp://a:1", "tcp://b:2", "tcp://c:3"]


def test_every_sender_ranks_the_nodes_alike_whatever_their_order() -> None:
    for key in ("img-1", "img-2", "x" * 64):
        first = NODES[rendezvous_order(key, NODES)[0]]
        shuffled = [NODES[2], NODES[0], NODES[1]]
        assert shuffled[rendezvous_order(key, shuffled)[0]] == first


def test_keys_spread_over_the_nodes_and_removing_one_moves_only_its_keys() -> None:
    keys = [f"item-{i}" for i in range(300)]
    owner = {k: NODES[rendezvous_order(k, NODES)[0]] for k in keys}
    counts = {n: sum(1 for o in owner.values() if o == n) for n in NODES}
    assert min(counts.values()) > 60, counts  # ~100 each
    rest = NODES[:2]
    for k in keys:
        new_owner = rest[rendezvous_order(k, rest)[0]]
        if owner[k] != NODES[2]:
            assert new_owner == owner[k]


def test_idle_pool_follows_affinity_and_a_busy_first_choice_is_passed_over() -> None:
    key = "picture"
    first = rendezvous_order(key, NODES)[0]
    assert choose_bounded(key, NODES, [0, 0, 0], cost=10, slack=0) == first
    loads = [0, 0, 0]
    loads[first] = 100  # bound = ceil(1.25 * 110 / 3) = 46
    chosen = choose_bounded(key, NODES, loads, cost=10, slack=0)
    assert chosen != first
    assert chosen == [i for i in rendezvous_order(key, NODES) if i != first][0]
    loads[first] = 20  # 20 + 10 > ceil(1.25 * 30 / 3) = 13: passed over
    assert choose_bounded(key, NODES, loads, cost=10, slack=0) != first
    loads = [5, 5, 5]  # even load: the bound ceil(1.25 * 25 / 3) = 11 >= 5 + 5
    assert choose_bounded(key, NODES, loads, cost=5, slack=0) == first


def test_a_queue_within_the_slack_keeps_the_affinity() -> None:
    """Two nodes, the first choice busy with one earlier item (or a stale figure of it), the
    other idle: the relative bound alone would move the picture; the slack keeps it."""
    key = "picture"
    first = rendezvous_order(key, NODES[:2])[0]
    loads = [0, 0]
    loads[first] = 600
    assert choose_bounded(key, NODES[:2], loads, cost=24) == first  # default slack
    # bound = max(ceil(1.25 * 624 / 2) = 390, 0 + 24 + slack): 624 fits slack 600, not 599
    assert choose_bounded(key, NODES[:2], loads, cost=24, slack=600) == first
    assert choose_bounded(key, NODES[:2], loads, cost=24, slack=599) != first
    loads[first] = AFFINITY_SLACK + 1  # beyond the slack and the fair share: passed over
    assert choose_bounded(key, NODES[:2], loads, cost=24) != first


def test_no_nodes_and_mismatched_loads() -> None:
    assert choose_bounded("k", [], [], cost=1) is None
    with pytest.raises(ValueError, match="2 nodes but 1 loads"):
        choose_bounded("k", NODES[:2], [0], cost=1)
