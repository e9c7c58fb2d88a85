"""ItemDataStore: where an item's pixels (or remote item) wait for the encoder, and are kept,
bounded, to encode it again after a preemption.

The engine core hands each new request's item data here (`Executor.add_mm_data`) when it adds
the request; the scheduler's request holds only the items' specs. Two places:

    pending  identifier -> data, held by the requests whose prefill has not passed the item:
             unbounded, exactly what the admitted requests brought (admission bounds them)
    kept     identifier -> data, for unfinished requests whose prefill has passed the item;
             an LRU bounded by `capacity_bytes` (--mm-reencode-cache-gb)

Once a step's window passes an item (`placeholder.end <= num_computed_tokens`) its data moves
from pending to kept; only a preempted request reads it there again (it recomputes from its
prompt, and an item neither covered by a prefix-cache hit nor resident in the encoder cache is
encoded again; the scheduler asks `holds` first). Entries go when their last holder finishes
(`release`) or, least recently stored first, when kept is over its byte budget: a request
that then needs that item again fails with a message that says so (`PixelsGone`). A remote
item (a disaggregated server) is kept the same way: its `RemoteItem` is what a preempted
request sends to the pool again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from mmserve.multimodal import ItemData, MultiModalFeature, RemoteItem


def held_bytes(data: ItemData) -> int:
    """Bytes an item's data keeps alive: its pixel buffer, or a remote item's payload (a URL
    item counts the URL's length: it holds nothing else)."""
    if isinstance(data, RemoteItem):
        return data.nbytes or len(data.url or "")
    return data.buffer_bytes


class ItemDataStore:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0  # what `kept` holds
        self.num_evicted = 0
        self.num_restored = 0
        self._pending: dict[str, tuple[ItemData, set[str]]] = {}
        self._kept: OrderedDict[str, tuple[ItemData, set[str]]] = OrderedDict()

    def __contains__(self, identifier: str) -> bool:
        """Kept for a re-encode (the bounded part)."""
        return identifier in self._kept

    def __len__(self) -> int:
        """Entries kept for a re-encode (the bounded part)."""
        return len(self._kept)

    def is_pending(self, identifier: str, request_id: str) -> bool:
        entry = self._pending.get(identifier)
        return entry is not None and request_id in entry[1]

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def holds(self, identifier: str) -> bool:
        """Whether the item can be encoded (again) from here."""
        return identifier in self._pending or identifier in self._kept

    def add(self, request_id: str, data: Mapping[str, ItemData]) -> None:
        """A new request's items, waiting for the encoder (one copy per identifier)."""
        for identifier, item in data.items():
            entry = self._pending.get(identifier)
            if entry is None:
                self._pending[identifier] = (item, {request_id})
            else:
                entry[1].add(request_id)

    def get(self, identifier: str) -> ItemData | None:
        """The item's data to encode or send it; None when it is gone."""
        entry = self._pending.get(identifier)
        if entry is not None:
            return entry[0]
        entry = self._kept.get(identifier)
        if entry is None:
            return None
        self._kept.move_to_end(identifier)
        self.num_restored += 1
        return entry[0]

    def pass_items(
        self, request_id: str, features: Iterable[MultiModalFeature], num_computed: int
    ) -> None:
        """The request's prefill stands at `num_computed`: the items it has passed are never
        encoded again unless it is preempted, so their data moves to the bounded part."""
        for feature in features:
            if feature.placeholder.end > num_computed:
                break  # items are sorted by offset
            entry = self._pending.get(feature.identifier)
            if entry is None or request_id not in entry[1]:
                continue
            entry[1].discard(request_id)
            if not entry[1]:
                del self._pending[feature.identifier]
            self._keep(feature.identifier, entry[0], request_id)

    def release(self, request_ids: Iterable[str]) -> None:
        """The requests are finished: drop what only they held."""
        gone = set(request_ids)
        for store, is_kept in ((self._pending, False), (self._kept, True)):
            for identifier in [i for i, (_, holders) in store.items() if holders & gone]:
                holders = store[identifier][1]
                holders -= gone
                if not holders:
                    self._drop(identifier, is_kept)

    def _keep(self, identifier: str, data: ItemData, request_id: str) -> None:
        entry = self._kept.get(identifier)
        if entry is not None:
            entry[1].add(request_id)
            self._kept.move_to_end(identifier)
            return
        size = held_bytes(data)
        if size > self.capacity_bytes:
            self.num_evicted += 1
            return  # it would evict everything and still not fit
        self._kept[identifier] = (data, {request_id})
        self.used_bytes += size
        while self.used_bytes > self.capacity_bytes:
            self._drop(next(iter(self._kept)), is_kept=True)
            self.num_evicted += 1

    def _drop(self, identifier: str, is_kept: bool) -> None:
        if is_kept:
            data, _ = self._kept.pop(identifier)
            self.used_bytes -= held_bytes(data)
        else:
            del self._pending[identifier]
