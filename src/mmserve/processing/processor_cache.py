"""CPU-side LRU of processed images keyed by identity, plus the (namespace, uuid) index."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from mmserve.multimodal import ProcessedImage

GIB = 1 << 30


@dataclass(slots=True)
class CacheStats:
    """Counters the engine's metrics read (monotonic; never reset here)."""

    queries: int = 0
    hits: int = 0


class ProcessorCache:
    """An LRU of ProcessedImage by identity, bounded by the bytes of the pixel arrays it holds.

    A capacity of 0 disables it: every get is a counted miss and put stores nothing. An item
    larger than the whole capacity is not stored (it would evict everything for one entry).
    Thread-safe: the server processes requests on worker threads.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.stats = CacheStats()
        self._items: OrderedDict[str, ProcessedImage] = OrderedDict()
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

    def __contains__(self, identity: str) -> bool:
        """Membership test that neither counts a query nor refreshes recency."""
        return identity in self._items

    def get(self, identity: str) -> ProcessedImage | None:
        with self._lock:
            self.stats.queries += 1
            item = self._items.get(identity)
            if item is None:
                return None
            self.stats.hits += 1
            self._items.move_to_end(identity)
            return item

    def put(self, identity: str, item: ProcessedImage) -> None:
        if item.nbytes > self.capacity_bytes:
            return
        with self._lock:
            old = self._items.pop(identity, None)
            if old is not None:
                self.used_bytes -= old.nbytes
            while self.used_bytes + item.nbytes > self.capacity_bytes:
                _, evicted = self._items.popitem(last=False)
                self.used_bytes -= evicted.nbytes
            self._items[identity] = item
            self.used_bytes += item.nbytes

    def check_integrity(self) -> None:
        assert self.used_bytes == sum(i.nbytes for i in self._items.values())
        assert 0 <= self.used_bytes <= max(self.capacity_bytes, 0)
        assert self.stats.hits <= self.stats.queries


@dataclass(frozen=True, slots=True)
class UUIDRecord:
    """What a UUID-only request needs to recompute the processing decision for its own kwargs."""

    width: int
    height: int
    mode: str


class UUIDIndex:
    """Bounded LRU (namespace, uuid) -> the original image's size and mode."""

    def __init__(self, max_entries: int = 65536) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries
        self._records: OrderedDict[tuple[str, str], UUIDRecord] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    def remember(self, namespace: str, uuid: str, record: UUIDRecord) -> None:
        with self._lock:
            key = (namespace, uuid)
            self._records[key] = record
            self._records.move_to_end(key)
            while len(self._records) > self.max_entries:
                self._records.popitem(last=False)

    def lookup(self, namespace: str, uuid: str) -> UUIDRecord | None:
        with self._lock:
            key = (namespace, uuid)
            record = self._records.get(key)
            if record is not None:
                self._records.move_to_end(key)
            return record
