"""Decode-memory budgets: one request's summed estimate, and a server-wide cap on bytes alive."""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from mmserve.errors import DecodeBusyError, ImageTooLargeError

Release = Callable[[], None]


class RequestDecodeBudget:
    """The estimated decode bytes of one request's images, summed, against a cap (0: no cap).

    Charged once per image when its header is read, never refunded: the cap bounds what one
    request may make the server hold, however its images overlap in time. Thread-safe (the
    images of one request decode concurrently).
    """

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0 (0: no cap), got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self._lock = threading.Lock()

    def charge(self, nbytes: int) -> None:
        with self._lock:
            total = self.used_bytes + nbytes
            if self.limit_bytes and total > self.limit_bytes:
                raise ImageTooLargeError(
                    f"the request's images need an estimated {total} bytes of memory to decode, "
                    f"over the {self.limit_bytes}-byte limit (--max-decode-bytes-per-request); "
                    "send fewer or smaller images",
                    param="image_url",
                )
            self.used_bytes = total


class DecodeMemoryGate:
    """The server-wide cap on the estimated bytes of decoded images alive at once (0: no cap).

    A decode reserves its estimate after the image header is read and before any pixel buffer
    exists, and keeps it while the decoded image lives (`hold_until_collected`): the buffers
    are only given back when the image is garbage, not when decoding returns. Waiters are
    served first come, first served, so a large decode is never starved by a stream of small
    ones; each waits at most `wait_timeout_s`, then fails with DecodeBusyError (503, retry).
    Thread-safe; it blocks, so call it from decode threads, never from the event loop.
    """

    def __init__(self, capacity_bytes: int, wait_timeout_s: float) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 (0: no cap), got {capacity_bytes}")
        if wait_timeout_s <= 0:
            raise ValueError(f"wait_timeout_s must be positive, got {wait_timeout_s}")
        self.capacity_bytes = capacity_bytes
        self.wait_timeout_s = wait_timeout_s
        self.in_use_bytes = 0
        self._waiters: deque[object] = deque()
        self._cond = threading.Condition()

    def reserve(self, nbytes: int) -> Release:
        """Wait (FIFO, bounded) until `nbytes` fit, take them; returns their idempotent release."""
        cap = self.capacity_bytes
        if cap and nbytes > cap:
            raise ImageTooLargeError(
                f"the image needs an estimated {nbytes} bytes of memory to decode, over the "
                f"{cap}-byte server-wide limit (--max-inflight-decode-bytes); downscale it",
                param="image_url",
            )
        with self._cond:
            ticket = object()
            self._waiters.append(ticket)
            deadline = time.monotonic() + self.wait_timeout_s
            try:
                while self._waiters[0] is not ticket or (cap and self.in_use_bytes + nbytes > cap):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise DecodeBusyError(
                            f"the server is busy decoding other images (waited "
                            f"{self.wait_timeout_s:g} s for decode memory); retry shortly"
                        )
                    self._cond.wait(remaining)
                self.in_use_bytes += nbytes
            finally:
                self._waiters.remove(ticket)
                self._cond.notify_all()
        return _OnceRelease(self, nbytes)

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self.in_use_bytes -= nbytes
            self._cond.notify_all()

    def check_integrity(self) -> None:
        assert self.in_use_bytes >= 0, "released more than was reserved"
        assert not self.capacity_bytes or self.in_use_bytes <= self.capacity_bytes


class _OnceRelease:
    """A reservation's release: the first call gives the bytes back, later calls do nothing."""

    __slots__ = ("_gate", "_nbytes", "_lock")

    def __init__(self, gate: DecodeMemoryGate, nbytes: int) -> None:
        self._gate: DecodeMemoryGate | None = gate
        self._nbytes = nbytes
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            gate, self._gate = self._gate, None
        if gate is not None:
            gate._release(self._nbytes)


def hold_until_collected(image: object, release: Release | None) -> None:
    """Keep a reservation for as long as `image` lives (CPython frees it when the last user
    drops it: after processing, or with a failed request's traceback)."""
    if release is not None:
        weakref.finalize(image, release)
