"""PixelStore: the pixels of items already encoded, kept (bounded) to encode them again.

A request holds an item's pixels only until its prefill has passed the item; then they move
here, keyed by identity, with the unfinished requests that may need them again. Only a
preempted request does (it recomputes from its prompt, and an item neither covered by a
prefix-cache hit nor resident in the encoder cache is encoded again). Entries go when their
last holder finishes, or, least recently stored first, when the store is over its byte budget:
a request that then needs that item again fails with a message that says so.

A remote item (a disaggregated server) is kept the same way: its `RemoteItem` (the image
file or array bytes it is sent with) is what a preempted request sends to the pool again.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import TYPE_CHECKING

from mmserve.errors import FailureKind, RequestFailure
from mmserve.multimodal import ProcessedImage, RemoteItem

if TYPE_CHECKING:
    from mmserve.scheduling.request import Request


class PixelsGone(Exception):
    """A preempted request needs an item's pixels the store has evicted."""

    def __init__(self, identifier: str) -> None:
        super().__init__(identifier)
        self.identifier = identifier

    def failure(self) -> RequestFailure:
        """What the request that needed the pixels fails with."""
        return RequestFailure(
            f"the engine no longer holds the pixels of item {self.identifier[:16]} to encode "
            "it again after a preemption (raise --mm-reencode-cache-gb)",
            FailureKind.INTERNAL,
        )


ItemData = ProcessedImage | RemoteItem


def held_bytes(data: ItemData) -> int:
    """Bytes an item's data keeps alive: its pixel buffer, or a remote item's payload (a URL
    item counts the URL's length: it holds nothing else)."""
    if isinstance(data, RemoteItem):
        return data.nbytes or len(data.url or "")
    return data.buffer_bytes


class PixelStore:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.num_evicted = 0
        self.num_restored = 0
        self._entries: OrderedDict[str, tuple[ItemData, set[str]]] = OrderedDict()

    def __contains__(self, identifier: str) -> bool:
        return identifier in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, identifier: str, data: ItemData, request_id: str) -> None:
        """Keep `data` for `request_id` (one copy per identifier, whoever stored it first)."""
        entry = self._entries.get(identifier)
        if entry is not None:
            entry[1].add(request_id)
            self._entries.move_to_end(identifier)
            return
        size = held_bytes(data)
        if size > self.capacity_bytes:
            self.num_evicted += 1
            return  # it would evict everything and still not fit
        self._entries[identifier] = (data, {request_id})
        self.used_bytes += size
        while self.used_bytes > self.capacity_bytes:
            self._evict()

    def get(self, identifier: str) -> ItemData | None:
        entry = self._entries.get(identifier)
        if entry is None:
            return None
        self._entries.move_to_end(identifier)
        self.num_restored += 1
        return entry[0]

    def stash_consumed(self, request: Request) -> None:
        """Items the prefill has passed are never encoded again unless the request is
        preempted: their pixels leave the request for this store."""
        num_computed = request.num_computed_tokens
        for item_idx, feature in enumerate(request.mm_features):
            if feature.data is not None and feature.placeholder.end <= num_computed:
                self.put(feature.identifier, feature.data, request.request_id)
                request.mm_features[item_idx] = dataclasses.replace(feature, data=None)
                request.stashed_pixels.add(feature.identifier)

    def restore(self, request: Request, item_idx: int) -> None:
        """A preempted request encodes an item again: its pixels come back from here.
        Raises PixelsGone when they were evicted."""
        feature = request.mm_features[item_idx]
        data = self.get(feature.identifier)
        if data is None:
            raise PixelsGone(feature.identifier)
        request.mm_features[item_idx] = dataclasses.replace(feature, data=data)

    def release(self, request_id: str, identifiers: set[str]) -> None:
        """The request is finished: drop what only it held."""
        for identifier in identifiers:
            entry = self._entries.get(identifier)
            if entry is None:
                continue
            entry[1].discard(request_id)
            if not entry[1]:
                self._drop(identifier)

    def _evict(self) -> None:
        identifier = next(iter(self._entries))
        self._drop(identifier)
        self.num_evicted += 1

    def _drop(self, identifier: str) -> None:
        data, _ = self._entries.pop(identifier)
        self.used_bytes -= held_bytes(data)
