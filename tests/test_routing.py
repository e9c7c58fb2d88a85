"""Rendezvous hashing bounded by load (mmserve/routing.py)."""

from __future__ import annotations

import pytest

from mmserve.routing import (
    AFFINITY_SLACK,
    Route,
    choose_bounded,
    rendezvous_order,
    route_by_content,
)

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


REPLICAS = ["replica-0", "replica-1"]


def test_a_request_goes_to_its_first_ranked_replica_while_within_the_bound() -> None:
    key = "item:abc"
    first = rendezvous_order(key, REPLICAS)[0]
    loads = [0, 0]
    loads[first] = 2  # bound: ceil(1.5 * 3 / 2) = 3, and 2 + 1 fits
    route = route_by_content(key, REPLICAS, loads, [False, False], load_slack=0.5)
    assert route == Route(first, True)


def test_over_the_bound_it_detours_by_load_and_an_idle_replica_always_takes_it() -> None:
    key = "item:abc"
    first = rendezvous_order(key, REPLICAS)[0]
    loads = [0, 0]
    loads[first] = 3  # bound ceil(1.5 * 4 / 2) = 3: 3 + 1 does not fit
    route = route_by_content(key, REPLICAS, loads, [False, False], load_slack=0.5)
    assert route == Route(1 - first, False)
    # epsilon 0 balances tightly: one request ahead is enough to move it
    loads[first] = 1
    route = route_by_content(key, REPLICAS, loads, [False, False], load_slack=0.0)
    assert route == Route(1 - first, False)


def test_a_replica_that_was_sent_the_key_is_preferred_over_the_first_ranked_one() -> None:
    key = "item:abc"
    first = rendezvous_order(key, REPLICAS)[0]
    holders = [False, False]
    holders[1 - first] = True  # a detour made the other replica hold it too
    loads = [1, 1]
    assert route_by_content(key, REPLICAS, loads, holders, load_slack=0.5) == Route(1 - first, True)
    holders[first] = True  # both hold it: the less loaded one
    loads[first] = 0
    assert route_by_content(key, REPLICAS, loads, holders, load_slack=0.5) == Route(first, True)


def test_no_replica_carries_more_than_the_bound_over_many_keys() -> None:
    nodes = [f"replica-{i}" for i in range(4)]
    loads = [0] * 4
    for n in range(200):  # nothing finishes: every load only grows
        route = route_by_content(f"item:{n % 7}", nodes, loads, [False] * 4, load_slack=0.25)
        assert route is not None
        loads[route.index] += 1
        assert max(loads) <= -(-1.25 * sum(loads) // 4), loads
    assert route_by_content("k", [], [], [], load_slack=0.5) is None
    with pytest.raises(ValueError, match="holders"):
        route_by_content("k", nodes, loads, [False], load_slack=0.5)
