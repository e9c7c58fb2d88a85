"""The encoder planner: where a request's window is cut for hits, budget, space, chunking and
items in flight, and which encoder-cache references it takes and drops.

The fake items have 4 input patches per embedding (see `tests/support/fake_runner.image`).
"""

from __future__ import annotations

import random

import msgspec
import pytest

from mmserve.multimodal import MultiModalFeature
from mmserve.scheduling import EncoderCacheManager, Request
from mmserve.scheduling.encoder_planner import (
    EncoderPlan,
    free_consumed_encoder_inputs,
    plan_encoder_inputs,
    reserve_encoder_inputs,
)
from tests.support.fake_runner import make_request

TWO_IMAGES = [("a", 10, 8), ("b", 30, 8)]  # 32 input patches each


def _remote(request: Request, *item_idxs: int) -> Request:
    """The items at `item_idxs` made remote (sent to an encoder pool instead of encoded)."""
    for i in item_idxs:
        f = request.mm_features[i]
        request.mm_features[i] = msgspec.structs.replace(f, is_remote=True)
    return request


def _plan(
    request: Request,
    manager: EncoderCacheManager,
    num_new: int,
    *,
    patch_budget: int = 10_000,
    disable_chunked_mm_input: bool = False,
) -> EncoderPlan:
    plan = plan_encoder_inputs(
        request,
        request.num_computed_tokens,
        num_new,
        manager=manager,
        item_data=None,
        patch_budget=patch_budget,
        disable_chunked_mm_input=disable_chunked_mm_input,
    )
    manager.check_integrity()
    return plan


def _reserve(
    request: Request, plan: EncoderPlan, manager: EncoderCacheManager
) -> tuple[dict[str, list[int]], dict[str, list[MultiModalFeature]], int]:
    local: dict[str, list[int]] = {}
    remote: dict[str, list[MultiModalFeature]] = {}
    num_patches = reserve_encoder_inputs(request, plan.item_idxs, manager, local, remote)
    manager.check_integrity()
    return local, remote, num_patches


def test_a_window_over_two_items_encodes_both_and_runs_whole() -> None:
    manager = EncoderCacheManager(1000)
    request = make_request("r", 60, TWO_IMAGES)
    plan = _plan(request, manager, 60)
    assert plan == EncoderPlan(60, [0, 1])
    local, remote, num_patches = _reserve(request, plan, manager)
    assert local == {"r": [0, 1]} and remote == {} and num_patches == 64
    assert manager.cached == {"a": {"r"}, "b": {"r"}}


@pytest.mark.parametrize(
    "patch_budget, expected",
    [(64, EncoderPlan(60, [0, 1])), (40, EncoderPlan(30, [0])), (31, EncoderPlan(10, []))],
)
def test_the_patch_budget_cuts_the_window_before_the_first_item_it_cannot_pay_for(
    patch_budget: int, expected: EncoderPlan
) -> None:
    manager = EncoderCacheManager(1000)
    request = make_request("r", 60, TWO_IMAGES)
    assert _plan(request, manager, 60, patch_budget=patch_budget) == expected
    assert manager.cached == {}  # planning reserves nothing


def test_a_full_cache_cuts_the_window_and_evicts_only_what_nobody_holds() -> None:
    manager = EncoderCacheManager(12)  # room for one 8-embedding item
    request = make_request("r", 60, TWO_IMAGES)
    plan = _plan(request, manager, 60)
    assert plan == EncoderPlan(30, [0])  # the text before b still runs
    _reserve(request, plan, manager)
    request.num_computed_tokens = 30
    free_consumed_encoder_inputs(request, manager)  # a is consumed: freeable, still resident
    manager.check_integrity()
    assert manager.freeable == {"a": 8}
    plan = _plan(request, manager, 30)
    assert plan == EncoderPlan(30, [1])
    assert manager.get_freed_identifiers() == ["a"]


def test_a_window_ending_inside_an_item_rolls_back_to_it_when_chunked_mm_input_is_off() -> None:
    manager = EncoderCacheManager(1000)
    request = make_request("r", 60, TWO_IMAGES)
    assert _plan(request, manager, 14) == EncoderPlan(14, [0])
    rolled = _plan(request, manager, 14, disable_chunked_mm_input=True)
    assert rolled == EncoderPlan(10, [], is_rolled_back=True)
    assert _plan(request, manager, 18, disable_chunked_mm_input=True) == EncoderPlan(18, [0])


def test_a_resident_item_is_a_hit_and_is_not_encoded_again() -> None:
    manager = EncoderCacheManager(1000)
    first = make_request("first", 40, [("a", 10, 8)])
    _reserve(first, _plan(first, manager, 40), manager)
    second = make_request("second", 40, [("a", 20, 8)])
    plan = _plan(second, manager, 40)
    assert plan == EncoderPlan(40, [])
    assert manager.cached["a"] == {"first", "second"}
    assert (manager.queries, manager.hits) == (2, 1)


def test_the_same_item_twice_in_one_request_is_encoded_once() -> None:
    manager = EncoderCacheManager(1000)
    request = make_request("r", 60, [("a", 5, 8), ("a", 30, 8)])
    plan = _plan(request, manager, 60)
    assert plan == EncoderPlan(60, [0])
    _, _, num_patches = _reserve(request, plan, manager)
    assert num_patches == 32


def test_remote_items_are_sent_together_and_the_window_waits_at_the_first() -> None:
    manager = EncoderCacheManager(1000)
    request = _remote(make_request("r", 60, TWO_IMAGES), 0, 1)
    plan = _plan(request, manager, 60, patch_budget=0)  # remote items need no local patches
    assert plan == EncoderPlan(10, [0, 1], is_waiting_on_arrival=True)
    local, remote, num_patches = _reserve(request, plan, manager)
    assert local == {} and num_patches == 0
    assert [f.identifier for f in remote["r"]] == ["a", "b"]
    assert manager.inflight == {"a", "b"}


def test_an_item_in_flight_for_another_request_cuts_the_window_and_keeps_a_reference() -> None:
    manager = EncoderCacheManager(1000)
    sender = _remote(make_request("sender", 40, [("a", 10, 8)]), 0)
    _reserve(sender, _plan(sender, manager, 40), manager)
    waiter = make_request("waiter", 40, [("a", 4, 8)])
    for _ in range(2):  # however often it looks, it waits and holds its reference
        plan = _plan(waiter, manager, 40)
        assert plan == EncoderPlan(4, [], is_waiting_on_arrival=True)
        assert manager.cached["a"] == {"sender", "waiter"}
    manager.free(sender)  # the sender is aborted: the waiter still needs the item
    manager.check_integrity()
    assert manager.is_inflight("a")
    assert manager.mark_arrived("a")
    assert _plan(waiter, manager, 40) == EncoderPlan(40, [])


def test_consumed_items_are_freed_unless_the_position_cuts_another_occurrence() -> None:
    manager = EncoderCacheManager(1000)
    request = make_request("r", 60, [("a", 5, 8), ("b", 20, 8), ("a", 40, 8)])
    _reserve(request, _plan(request, manager, 60), manager)
    request.num_computed_tokens = 44  # inside the second `a`
    free_consumed_encoder_inputs(request, manager)
    manager.check_integrity()
    assert manager.cached == {"a": {"r"}, "b": set()}
    request.num_computed_tokens = 48
    free_consumed_encoder_inputs(request, manager)
    assert manager.cached == {"a": set(), "b": set()}
    manager.check_integrity()


def _random_request(rng: random.Random, request_id: str) -> Request:
    num_tokens = rng.randint(20, 120)
    images, offset = [], rng.randint(0, 10)
    while offset + 4 <= num_tokens and len(images) < 4:
        length = rng.randint(2, min(16, num_tokens - offset))
        images.append((f"img{rng.randrange(6)}", offset, length))
        offset += length + rng.randint(0, 15)
    request = make_request(request_id, num_tokens, images)
    return _remote(request, *[i for i in range(len(images)) if rng.random() < 0.3])


@pytest.mark.parametrize("seed", range(8))
def test_randomised_steps_only_ever_run_windows_whose_items_are_resident(seed: int) -> None:
    """Requests advance through plan, reserve, arrival and freeing, as the scheduler drives
    them; after every operation the cache's books balance, and every item a planned window
    overlaps is resident, arrived and held by the request (else the runner would crash)."""
    rng = random.Random(seed)
    manager = EncoderCacheManager(rng.choice([16, 40, 200]))
    active = [_random_request(rng, f"r{i}") for i in range(4)]
    num_started = len(active)
    for _ in range(300):
        if not active:
            break
        budget = rng.choice([8, 40, 1000])
        num_local_patches = 0
        for request in list(active):
            left = request.num_prompt_tokens - request.num_computed_tokens
            num_new = rng.randint(1, left)
            plan = _plan(
                request,
                manager,
                num_new,
                patch_budget=budget - num_local_patches,
                disable_chunked_mm_input=rng.random() < 0.3,
            )
            assert 0 <= plan.num_new_tokens <= num_new
            num_local_patches += _reserve(request, plan, manager)[2]
            assert num_local_patches <= budget, "the step's patch budget was overrun"
            start = request.num_computed_tokens
            end = start + plan.num_new_tokens
            for f in request.mm_features:
                if f.placeholder.offset < end and start < f.placeholder.end:
                    assert request.request_id in manager.cached.get(f.identifier, ())
                    assert not manager.is_inflight(f.identifier), "ran over an unarrived item"
            request.num_computed_tokens = end
            free_consumed_encoder_inputs(request, manager)
            manager.check_integrity()
            if request.num_computed_tokens == request.num_prompt_tokens or rng.random() < 0.05:
                manager.free(request)  # finished, or aborted
                manager.check_integrity()
                active.remove(request)
                if num_started < 20:
                    active.append(_random_request(rng, f"r{num_started}"))
                    num_started += 1
        for identifier in sorted(manager.inflight):
            if rng.random() < 0.6:
                assert manager.mark_arrived(identifier)
        manager.get_freed_identifiers()
        manager.check_integrity()
    assert not active and num_started == 20, "requests stalled"
    assert manager.inflight == set() and all(not holders for holders in manager.cached.values())
