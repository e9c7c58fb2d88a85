"""Encoder-output cache bookkeeping: slots, per-request references, lazy LRU eviction."""

from __future__ import annotations

from collections import OrderedDict

from mmserve.scheduling.request import Request


class EncoderCacheManager:
    """Tracks which encoder outputs are resident in the runner's cache, in embedding slots.

    - `cached`: identifier -> ids of the requests that still need it. An empty set means the
      entry is resident but unreferenced: it is also in `freeable` (LRU order, oldest first)
      and a later request with the same identifier gets it for free.
    - Eviction is logical here (in `can_allocate`, only when free slots run short); evicted
      identifiers collect in `freed` until the scheduler drains them into its output, and the
      runner drops the tensors at the top of that step.

    `num_free_slots` counts slots no resident entry holds; `num_freeable_slots` adds the slots
    of unreferenced entries (what could be had by evicting).
    """

    def __init__(self, cache_size: int, bytes_per_slot: int = 0) -> None:
        self.cache_size = cache_size
        self.bytes_per_slot = bytes_per_slot
        self.cached: dict[str, set[str]] = {}
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.freed: list[str] = []
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        self._num_embeds: dict[str, int] = {}  # identifier -> slots, for every resident entry
        self.queries = 0  # (request, item identity) pairs that needed an encoder output
        self.hits = 0  # ... of which were already resident

    @property
    def num_used_slots(self) -> int:
        """Slots held by resident entries, referenced or not."""
        return self.cache_size - self.num_free_slots

    @property
    def num_referenced_slots(self) -> int:
        """Slots held by entries some unfinished request still needs (not reclaimable)."""
        return self.cache_size - self.num_freeable_slots

    @property
    def num_bytes(self) -> int:
        """Byte cost of the whole cache (slots x hidden size x dtype size)."""
        return self.cache_size * self.bytes_per_slot

    def check_and_update_cache(self, request: Request, item_idx: int) -> bool:
        """True if the item's output is resident; then the request holds a reference to it
        (un-freeing it if nobody did). A request that already holds it is not re-counted."""
        identifier = request.mm_features[item_idx].identifier
        holders = self.cached.get(identifier)
        if holders is None:
            return False
        if request.request_id in holders:
            return True
        if not holders:
            self.num_freeable_slots -= self.freeable.pop(identifier)
        holders.add(request.request_id)
        self.queries += 1
        self.hits += 1
        return True

    def can_allocate(
        self, request: Request, item_idx: int, compute_budget: int, num_embeds_to_schedule: int
    ) -> bool:
        """Whether the item can be encoded this step: within the remaining compute budget, and
        with space for it on top of `num_embeds_to_schedule` already promised this step.
        Evicts unreferenced entries (oldest first) only when free slots alone fall short."""
        num_embeds = request.mm_features[item_idx].num_embeds
        if num_embeds > compute_budget:
            return False
        num_needed = num_embeds + num_embeds_to_schedule
        if num_needed <= self.num_free_slots:
            return True
        if num_needed > self.num_freeable_slots:
            return False
        while num_needed > self.num_free_slots:
            identifier, num_slots = self.freeable.popitem(last=False)
            del self.cached[identifier]
            del self._num_embeds[identifier]
            self.freed.append(identifier)
            self.num_free_slots += num_slots
        return True

    def allocate(self, request: Request, item_idx: int) -> None:
        """Reserve slots for an item the runner will encode this step (after `can_allocate`)."""
        feature = request.mm_features[item_idx]
        assert feature.identifier not in self.cached, "allocate of a resident entry"
        assert feature.num_embeds <= self.num_free_slots, "allocate without can_allocate"
        self.cached[feature.identifier] = {request.request_id}
        self._num_embeds[feature.identifier] = feature.num_embeds
        self.num_free_slots -= feature.num_embeds
        self.num_freeable_slots -= feature.num_embeds
        self.queries += 1

    def free_encoder_input(self, request: Request, item_idx: int) -> None:
        """Drop the request's reference; an entry nobody needs becomes freeable (stays resident)."""
        identifier = request.mm_features[item_idx].identifier
        holders = self.cached.get(identifier)
        if holders is None or request.request_id not in holders:
            return
        holders.discard(request.request_id)
        if not holders:
            num_slots = self._num_embeds[identifier]
            self.freeable[identifier] = num_slots
            self.num_freeable_slots += num_slots

    def free(self, request: Request) -> None:
        """Drop every reference the request holds (finish, abort, preemption)."""
        for item_idx in range(len(request.mm_features)):
            self.free_encoder_input(request, item_idx)

    def get_freed_identifiers(self) -> list[str]:
        """Drain the identifiers evicted since the last call (the runner frees them)."""
        freed, self.freed = self.freed, []
        return freed

    def check_integrity(self) -> None:
        assert set(self._num_embeds) == set(self.cached), "size table out of sync"
        for identifier, holders in self.cached.items():
            assert (not holders) == (identifier in self.freeable), identifier
        for identifier, num_slots in self.freeable.items():
            assert self._num_embeds.get(identifier) == num_slots, identifier
        resident = sum(self._num_embeds.values())
        assert self.num_free_slots == self.cache_size - resident, "free slots drifted"
        assert 0 <= self.num_free_slots <= self.cache_size
        assert self.num_freeable_slots == self.num_free_slots + sum(self.freeable.values())
        assert self.hits <= self.queries
