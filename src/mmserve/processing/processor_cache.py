"""CPU-side LRU of processed images keyed by identity, plus the (namespace, uuid) index."""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass

from mmserve.multimodal import EncoderInput, RemoteItem

GIB = 1 << 30
# What an entry costs beyond its pixel buffer and its key: the ndarray objects (the array and
# the view it is reshaped into), the EncoderInput and its grid tuple, the OrderedDict node.
# tracemalloc measures ~400 bytes on CPython 3.11 (tests/processing/test_processor_cache.py).
CACHE_ENTRY_OVERHEAD_BYTES = 512
# The same for a UUID record: key tuple, UUIDRecord with its two ints, the OrderedDict node
# (~250 bytes measured).
UUID_ENTRY_OVERHEAD_BYTES = 320
# About the 65,536 entries of the old count limit for 36-character uuids (70,000); 48,000 of
# 256 characters, the longest a caller may send.
DEFAULT_UUID_INDEX_BYTES = 32 << 20


@dataclass(slots=True)
class CacheStats:
    """Counters the engine's metrics read (monotonic; never reset here)."""

    queries: int = 0
    hits: int = 0


CachedItem = EncoderInput | RemoteItem  # a remote item: what a disaggregated server planned


def cache_entry_bytes(identifier: str, item: CachedItem) -> int:
    """What holding `item` under `identifier` costs: its whole pixel buffer (a remote item: its
    payload and URL), the key, overhead."""
    held = item.nbytes + len(item.url or "") if isinstance(item, RemoteItem) else item.buffer_bytes
    return held + sys.getsizeof(identifier) + CACHE_ENTRY_OVERHEAD_BYTES


class ProcessorCache:
    """An LRU of EncoderInput (or RemoteItem) by identity, bounded by what entries really hold.

    An entry costs `cache_entry_bytes`: the pixel buffer (all of it, when the array is a view),
    the key and a fixed per-entry overhead. A capacity of 0 disables the cache: every get is a
    counted miss and put stores nothing. An entry larger than the whole capacity is not stored
    (it would evict everything for one entry).
    Thread-safe: the server processes requests on worker threads.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.stats = CacheStats()
        self._items: OrderedDict[str, tuple[CachedItem, int]] = OrderedDict()  # (item, cost)
        self._lock = threading.Lock()

    @classmethod
    def from_gb(cls, cache_gb: float) -> ProcessorCache:
        """Sized by --mm-processor-cache-gb (GiB, as vLLM; 0 disables)."""
        if cache_gb < 0:
            raise ValueError(f"--mm-processor-cache-gb must be >= 0, got {cache_gb}")
        return cls(int(cache_gb * GIB))

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, identifier: str) -> bool:
        """Membership test that neither counts a query nor refreshes recency."""
        return identifier in self._items

    def get(self, identifier: str) -> CachedItem | None:
        with self._lock:
            self.stats.queries += 1
            entry = self._items.get(identifier)
            if entry is None:
                return None
            self.stats.hits += 1
            self._items.move_to_end(identifier)
            return entry[0]

    def put(self, identifier: str, item: CachedItem) -> None:
        cost = cache_entry_bytes(identifier, item)
        if cost > self.capacity_bytes:
            return
        with self._lock:
            old = self._items.pop(identifier, None)
            if old is not None:
                self.used_bytes -= old[1]
            while self.used_bytes + cost > self.capacity_bytes:
                _, (_, evicted_cost) = self._items.popitem(last=False)
                self.used_bytes -= evicted_cost
            self._items[identifier] = (item, cost)
            self.used_bytes += cost

    def check_integrity(self) -> None:
        with self._lock:
            for identifier, (item, cost) in self._items.items():
                assert cost == cache_entry_bytes(identifier, item), identifier
            assert self.used_bytes == sum(cost for _, cost in self._items.values())
            assert 0 <= self.used_bytes <= self.capacity_bytes
            assert self.stats.hits <= self.stats.queries


@dataclass(frozen=True, slots=True)
class UUIDRecord:
    """What a UUID-only request needs to recompute the processing decision for its own kwargs."""

    width: int
    height: int
    mode: str


class UUIDIndex:
    """LRU (namespace, uuid) -> what planning needs of the item (an image's `UUIDRecord`, a
    video's `VideoMeta`), bounded in bytes.

    An entry costs the two key strings as Python holds them plus a fixed overhead, so that
    long uuids take their share of the budget instead of hiding behind an entry count.
    """

    def __init__(self, capacity_bytes: int = DEFAULT_UUID_INDEX_BYTES) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._records: OrderedDict[tuple[str, str], tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    @staticmethod
    def entry_bytes(namespace: str, uuid: str) -> int:
        return sys.getsizeof(namespace) + sys.getsizeof(uuid) + UUID_ENTRY_OVERHEAD_BYTES

    def remember(self, namespace: str, uuid: str, record: object) -> None:
        cost = self.entry_bytes(namespace, uuid)
        if cost > self.capacity_bytes:
            return
        with self._lock:
            key = (namespace, uuid)
            old = self._records.pop(key, None)
            if old is not None:
                self.used_bytes -= old[1]
            while self.used_bytes + cost > self.capacity_bytes:
                _, (_, evicted_cost) = self._records.popitem(last=False)
                self.used_bytes -= evicted_cost
            self._records[key] = (record, cost)
            self.used_bytes += cost

    def lookup(self, namespace: str, uuid: str) -> object | None:
        with self._lock:
            key = (namespace, uuid)
            entry = self._records.get(key)
            if entry is None:
                return None
            self._records.move_to_end(key)
            return entry[0]

    def check_integrity(self) -> None:
        with self._lock:
            for (namespace, uuid), (_, cost) in self._records.items():
                assert cost == self.entry_bytes(namespace, uuid), uuid
            assert self.used_bytes == sum(cost for _, cost in self._records.values())
            assert 0 <= self.used_bytes <= self.capacity_bytes
