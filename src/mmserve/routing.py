"""Content routing: send an item to the node most likely to hold it, unless that node is busy.

Rendezvous (highest-random-weight) hashing ranks the nodes for a key: every sender ranks them
the same way without talking to the others, and removing a node moves only the keys it was
first for. A picture sent by two language servers therefore meets the same encoder, whose
embedding cache answers the second request. Load bounds the affinity: the first-ranked node
is skipped only while it carries both more than its fair share (1.25x the mean) of the work in
flight and more than AFFINITY_SLACK beyond the least-loaded node, so a burst cannot queue
behind one node while others idle, but a short queue (or a load figure a moment stale, as an
encoder's last pong is) never sends a picture away from the node that has it.

`choose_bounded` routes items to encoders (the pool); `route_by_content` routes requests to
data-parallel replicas, with load in requests and a replica's memory of the keys it was sent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import blake3

LOAD_SLACK = 0.25  # a node may carry up to 1.25x the mean load (counting the new item) first
# ... or this much more than the least-loaded node: in encoder input patches, four 1024x1024
# pictures at patch 16 (a wait shorter than that costs less than encoding the item again)
AFFINITY_SLACK = 16384


def _weight(key: str, node: str) -> int:
    digest = blake3.blake3(f"{len(key)}:{key}|{node}".encode()).digest(length=8)
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, nodes: Sequence[str]) -> list[int]:
    """Indices of `nodes`, most preferred for `key` first (ties cannot depend on order)."""
    return sorted(range(len(nodes)), key=lambda i: (-_weight(key, nodes[i]), nodes[i]))


def choose_bounded(
    key: str,
    nodes: Sequence[str],
    loads: Sequence[int],
    cost: int,
    *,
    slack: int = AFFINITY_SLACK,
) -> int | None:
    """The index of the node to send a `cost`-sized item with `key` to, or None if no nodes.

    The highest-ranked node whose load after taking the item stays within the bound: the
    larger of ceil((1 + LOAD_SLACK) * (total load + cost) / len(nodes)) and the least load +
    cost + `slack`. An idle node is always within it, and so is the least-loaded node, so a
    choice is always made."""
    if len(nodes) != len(loads):
        raise ValueError(f"{len(nodes)} nodes but {len(loads)} loads")
    if not nodes:
        return None
    cost = max(cost, 0)
    fair = math.ceil((1 + LOAD_SLACK) * (sum(loads) + cost) / len(nodes))
    bound = max(fair, min(loads) + cost + slack)
    order = rendezvous_order(key, nodes)
    for i in order:
        if loads[i] == 0 or loads[i] + cost <= bound:
            return i
    return min(order, key=lambda i: loads[i])


class Route(NamedTuple):
    """Where one request goes, and whether content chose it (`by_affinity`) or load did."""

    index: int
    by_affinity: bool


def route_by_content(
    key: str,
    nodes: Sequence[str],
    loads: Sequence[int],
    holders: Sequence[bool],
    *,
    load_slack: float,
) -> Route | None:
    """The node for a request whose content has `key` (None when there are no nodes).

    `loads[i]` is node i's work in flight (in requests), `holders[i]` whether node i was sent
    `key` lately (so its caches probably hold it). The bound is ceil((1 + load_slack) * (total
    load + 1) / len(nodes)); an idle node is always within it. In order:

    1. the least-loaded holder within the bound (affinity: no new encode, no new prefill);
    2. else the first node in `key`'s rendezvous order within the bound: affinity if that is
       the key's first-ranked node (a key's first request), load otherwise (a detour: the
       key is encoded on one more node, at most once per node);
    3. else (only when every node is over the bound, impossible with load_slack >= 0) the
       least-loaded node, by load.
    """
    if not len(nodes) == len(loads) == len(holders):
        raise ValueError(f"{len(nodes)} nodes, {len(loads)} loads, {len(holders)} holders")
    if not nodes:
        return None
    bound = math.ceil((1 + load_slack) * (sum(loads) + 1) / len(nodes))
    order = rendezvous_order(key, nodes)
    within = [i for i in order if loads[i] == 0 or loads[i] + 1 <= bound]
    held = [i for i in within if holders[i]]
    if held:
        return Route(min(held, key=lambda i: loads[i]), True)
    if within:
        return Route(within[0], within[0] == order[0])
    return Route(min(order, key=lambda i: loads[i]), False)
