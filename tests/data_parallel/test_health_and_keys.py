"""What /health says of replicas, and what a request is routed by (no engine processes)."""

from __future__ import annotations

import json

from mmserve.api.health import replica_health
from mmserve.engine.frontend.replicas import ReplicaState, routing_key
from mmserve.multimodal import MultiModalFeature, PlaceholderRange, ProcessedPrompt

LIVE = ReplicaState(0, "cuda:0", True, None, 7)
DOWN = ReplicaState(1, "cuda:1", False, "the engine process exited (killed by signal 9)", 3)


def _body(states: list[ReplicaState]) -> tuple[int, dict]:
    response = replica_health(states)
    return response.status_code, json.loads(response.body)


def test_health_is_ok_then_degraded_but_200_then_503_when_no_replica_lives() -> None:
    status, body = _body([LIVE, LIVE._replace(index=1)])
    assert status == 200 and body["status"] == "ok" and body["replicas_live"] == 2
    status, body = _body([LIVE, DOWN])
    assert status == 200 and body["status"] == "degraded"
    assert body["replicas"][1] == {
        "replica": 1,
        "device": "cuda:1",
        "state": "restarting",
        "requests": 3,
        "reason": "the engine process exited (killed by signal 9)",
    }
    status, body = _body([DOWN._replace(index=0), DOWN])
    assert status == 503 and body["status"] == "unavailable" and body["replicas_live"] == 0


def _feature(identifier: str, offset: int) -> MultiModalFeature:
    return MultiModalFeature(identifier, "image", PlaceholderRange(offset, 4), (1, 4, 4))


def test_a_request_is_routed_by_its_first_item_else_by_its_first_block_and_salt() -> None:
    items = ProcessedPrompt(list(range(40)), [_feature("a" * 64, 2), _feature("b" * 64, 20)])
    assert routing_key(items, None, 16) == "item:" + "a" * 64
    assert routing_key(items, "salt", 16) == routing_key(items, None, 16)
    text = ProcessedPrompt(list(range(40)))
    same_first_block = ProcessedPrompt([*range(16), 99, 98])
    assert routing_key(text, None, 16) == routing_key(same_first_block, None, 16)
    assert routing_key(text, None, 16) != routing_key(ProcessedPrompt([1, *range(16)]), None, 16)
    assert routing_key(text, "tenant-a", 16) != routing_key(text, None, 16)
    assert routing_key(text, "tenant-a", 16) != routing_key(text, "tenant-b", 16)
