"""Encoder-output cache bookkeeping: a byte ledger, per-request references, lazy LRU eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from mmserve.errors import RequestFailure
from mmserve.scheduling.request import Request


class EncoderCacheManager:
    """Tracks which encoder outputs are resident in the runner's cache, in bytes.

    An entry costs `num_embeds * bytes_per_embed` bytes: the size of the [num_embeds, width]
    tensor the runner keeps (one encoder output row per embedding: hidden size x (1 + DeepStack
    levels) x dtype size), so the ledger and the runner's memory agree to the byte.

    - `cached`: identifier -> ids of the requests that still need it. An empty set means the
      entry is resident but unreferenced: it is also in `freeable` (LRU order, oldest first,
      with its bytes) and a later request with the same identifier gets it for free.
    - Eviction is logical here (in `can_allocate`, only when free bytes run short); evicted
      identifiers collect in `freed` until the scheduler drains them into its output, and the
      runner drops the tensors at the top of that step.

    - In flight (`inflight`): an entry allocated for a remote item (`allocate(...,
      is_remote=True)`) is in the ledger, its bytes reserved (the pool of arrived remote
      embeddings is this same ledger), but not arrived: nobody may read it until
      `mark_arrived`. `fail` drops it and hands back its holders. An in-flight entry that
      loses its last holder (abort, preemption, finish) is cancelled: dropped, and its
      identifier goes to `freed`, so the runner cancels it at its source (a late reply is
      dropped there). In-flight entries are never freeable, so never evicted.

    `num_free_bytes` counts bytes no resident entry holds; `num_freeable_bytes` adds the bytes
    of unreferenced entries (what could be had by evicting).
    """

    def __init__(self, capacity_bytes: int, bytes_per_embed: int = 1) -> None:
        assert capacity_bytes >= 0 and bytes_per_embed > 0
        self.capacity_bytes = capacity_bytes
        self.bytes_per_embed = bytes_per_embed
        self.cached: dict[str, set[str]] = {}
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.freed: list[str] = []
        self.num_free_bytes = capacity_bytes
        self.num_freeable_bytes = capacity_bytes
        self._entry_bytes: dict[str, int] = {}  # identifier -> bytes, for every resident entry
        self.inflight: set[str] = set()  # resident in the ledger, not arrived yet
        self.num_inflight_bytes = 0
        # remote entries (in flight or arrived) still in the ledger; the arrived ones are the
        # language-side embedding pool (`num_pool_bytes`), counted like any local entry
        self.remote: set[str] = set()
        self.num_pool_bytes = 0
        self.queries = 0  # (request, item identity) pairs that needed an encoder output
        self.hits = 0  # ... of which were already resident

    def item_bytes(self, request: Request, item_idx: int) -> int:
        return request.mm_features[item_idx].num_embeds * self.bytes_per_embed

    @property
    def num_used_bytes(self) -> int:
        """Bytes held by resident entries, referenced or not."""
        return self.capacity_bytes - self.num_free_bytes

    @property
    def num_referenced_bytes(self) -> int:
        """Bytes held by entries some unfinished request still needs (not reclaimable)."""
        return self.capacity_bytes - self.num_freeable_bytes

    # Embedding-slot views of the ledger, for the slot gauges (one slot = one embedding).
    @property
    def num_used_slots(self) -> int:
        return self.num_used_bytes // self.bytes_per_embed

    @property
    def num_referenced_slots(self) -> int:
        return self.num_referenced_bytes // self.bytes_per_embed

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
            self.num_freeable_bytes -= self.freeable.pop(identifier)
        holders.add(request.request_id)
        self.queries += 1
        self.hits += 1
        return True

    def can_allocate(
        self, request: Request, item_idx: int, patch_budget: int, num_bytes_to_schedule: int
    ) -> bool:
        """Whether the item can be encoded this step: its input patches within the step's
        remaining `patch_budget`, and space for it on top of `num_bytes_to_schedule` already
        promised this step. Evicts unreferenced entries (oldest first) only when free bytes
        alone fall short."""
        if request.mm_features[item_idx].num_patches > patch_budget:
            return False
        num_needed = self.item_bytes(request, item_idx) + num_bytes_to_schedule
        if num_needed <= self.num_free_bytes:
            return True
        if num_needed > self.num_freeable_bytes:
            return False
        while num_needed > self.num_free_bytes:
            identifier, num_bytes = self.freeable.popitem(last=False)
            del self.cached[identifier]
            del self._entry_bytes[identifier]
            if identifier in self.remote:  # freeable, so arrived: it leaves the pool
                self.remote.discard(identifier)
                self.num_pool_bytes -= num_bytes
            self.freed.append(identifier)
            self.num_free_bytes += num_bytes
        return True

    def is_inflight(self, identifier: str) -> bool:
        """Sent to the encoder source and not arrived: it blocks every window that reaches it."""
        return identifier in self.inflight

    def allocate(self, request: Request, item_idx: int, *, is_remote: bool = False) -> None:
        """Reserve bytes for an item the runner will encode this step (after `can_allocate`);
        `is_remote`: it is sent to the encoder source instead, and stays in flight until
        `mark_arrived`."""
        identifier = request.mm_features[item_idx].identifier
        num_bytes = self.item_bytes(request, item_idx)
        assert identifier not in self.cached, "allocate of a resident entry"
        assert num_bytes <= self.num_free_bytes, "allocate without can_allocate"
        self.cached[identifier] = {request.request_id}
        self._entry_bytes[identifier] = num_bytes
        self.num_free_bytes -= num_bytes
        self.num_freeable_bytes -= num_bytes
        self.queries += 1
        if is_remote:
            self.inflight.add(identifier)
            self.remote.add(identifier)
            self.num_inflight_bytes += num_bytes

    def mark_arrived(self, identifier: str) -> bool:
        """The runner holds the item's embeddings now. False (ignored) when it is not in
        flight: cancelled since it was sent, or failed."""
        if identifier not in self.inflight:
            return False
        self.inflight.discard(identifier)
        self.num_inflight_bytes -= self._entry_bytes[identifier]
        self.num_pool_bytes += self._entry_bytes[identifier]
        return True

    def fail(self, identifier: str) -> set[str]:
        """Nobody could encode the in-flight item: drop it (its identifier goes to `freed`)
        and return the ids of the requests that held it (they fail). Empty when it is not in
        flight (cancelled already)."""
        if identifier not in self.inflight:
            return set()
        holders = self.cached[identifier]
        self._drop_inflight(identifier)
        # NOTE: the runner drops a failed item itself; freeing it again is a no-op there, but
        # after a step that raised (whose arrivals were lost) it cancels what it still waits
        # for and frees what it took, so its cache never holds what the ledger does not.
        self.freed.append(identifier)
        return holders

    def apply_remote_results(
        self, arrived: Iterable[str], failed: Mapping[str, RequestFailure]
    ) -> dict[str, RequestFailure]:
        """Mark `arrived` items arrived and drop `failed` ones; returns the requests that held
        a failed item, each with its (first) failure. Items no longer in flight are ignored."""
        for identifier in arrived:
            self.mark_arrived(identifier)
        failing: dict[str, RequestFailure] = {}
        for identifier, failure in failed.items():
            for request_id in sorted(self.fail(identifier)):
                failing.setdefault(request_id, failure)
        return failing

    def _drop_inflight(self, identifier: str) -> None:
        num_bytes = self._entry_bytes.pop(identifier)
        del self.cached[identifier]
        self.inflight.discard(identifier)
        self.remote.discard(identifier)
        self.num_inflight_bytes -= num_bytes
        self.num_free_bytes += num_bytes
        self.num_freeable_bytes += num_bytes

    def free_encoder_input(self, request: Request, item_idx: int) -> None:
        """Drop the request's reference; an entry nobody needs becomes freeable (stays resident)."""
        identifier = request.mm_features[item_idx].identifier
        holders = self.cached.get(identifier)
        if holders is None or request.request_id not in holders:
            return
        holders.discard(request.request_id)
        if not holders and identifier in self.inflight:
            # NOTE: nobody waits for it any more: cancel rather than keep bytes for a reply
            # that may never be wanted (the runner tells its source; a late reply is dropped).
            self._drop_inflight(identifier)
            self.freed.append(identifier)
        elif not holders:
            num_bytes = self._entry_bytes[identifier]
            self.freeable[identifier] = num_bytes
            self.num_freeable_bytes += num_bytes

    def free(self, request: Request) -> None:
        """Drop every reference the request holds (finish, abort, preemption)."""
        for item_idx in range(len(request.mm_features)):
            self.free_encoder_input(request, item_idx)

    def get_freed_identifiers(self) -> list[str]:
        """Drain the identifiers evicted since the last call (the runner frees them)."""
        freed, self.freed = self.freed, []
        return freed

    def check_integrity(self) -> None:
        assert set(self._entry_bytes) == set(self.cached), "size table out of sync"
        for identifier, holders in self.cached.items():
            assert (not holders) == (identifier in self.freeable), identifier
        for identifier, num_bytes in self.freeable.items():
            assert self._entry_bytes.get(identifier) == num_bytes, identifier
        resident = sum(self._entry_bytes.values())
        assert self.num_free_bytes == self.capacity_bytes - resident, "free bytes drifted"
        assert 0 <= self.num_free_bytes <= self.capacity_bytes
        assert self.num_freeable_bytes == self.num_free_bytes + sum(self.freeable.values())
        assert self.hits <= self.queries
        assert self.inflight <= set(self.cached), "an in-flight entry left the ledger"
        assert all(self.cached[i] for i in self.inflight), "an in-flight entry without holders"
        assert self.num_inflight_bytes == sum(self._entry_bytes[i] for i in self.inflight)
        assert self.inflight <= self.remote <= set(self.cached), "a remote entry left the ledger"
        arrived = self.remote - self.inflight
        assert self.num_pool_bytes == sum(self._entry_bytes[i] for i in arrived), "pool drifted"
