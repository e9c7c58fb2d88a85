"""A least-recently-used store bounded by bytes: the encoder's embedding cache, and its store of
URL bytes fetched for a plan (so the encode that follows need not fetch them again)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class CachedEmbedding:
    """One item's encoder output as it is sent: C-contiguous bytes of [num_embeds,
    embedding_width] (hidden size x (1 + DeepStack levels)); the cache counts all of them."""

    data: bytes
    dtype: str  # "float32" | "bfloat16" | "float16"
    shape: tuple[int, int]
    grid_thw: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True, slots=True)
class _Entry(Generic[V]):
    value: V
    nbytes: int
    stored_at: float


class ByteBudgetLRU(Generic[V]):
    """key -> value, evicting the least recently used when the bytes go over `capacity_bytes`.

    A value larger than the whole budget is not stored. `ttl_s` (None: none) also expires
    entries by age, checked on access. Not thread-safe: one event loop owns it.
    """

    def __init__(
        self,
        capacity_bytes: int,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, _Entry[V]] = OrderedDict()
        self._num_bytes = 0

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self._ttl_s is not None and self._clock() - entry.stored_at > self._ttl_s:
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return entry.value

    def put(self, key: str, value: V, nbytes: int) -> bool:
        """Store (or refresh) `key`; False when the value alone is over the budget."""
        if key in self._entries:
            self._drop(key)
        if nbytes > self.capacity_bytes:
            return False
        while self._num_bytes + nbytes > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = _Entry(value, nbytes, self._clock())
        self._num_bytes += nbytes
        return True

    def _drop(self, key: str) -> None:
        self._num_bytes -= self._entries.pop(key).nbytes

    def check_integrity(self) -> None:
        assert self._num_bytes == sum(e.nbytes for e in self._entries.values())
        assert 0 <= self._num_bytes <= self.capacity_bytes
