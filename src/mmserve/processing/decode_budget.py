"""Decode-memory budgets: one request's summed estimate, and a server-wide cap on bytes alive."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from collections.abc import Callable

from mmserve.errors import DecodeBusyError, ImageTooLargeError, VideoTooLargeError

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

    def charge(self, nbytes: int, what: str = "image") -> None:
        """`what`: "image" or "video", the kind of item charged (for the error)."""
        with self._lock:
            total = self.used_bytes + nbytes
            if self.limit_bytes and total > self.limit_bytes:
                error = VideoTooLargeError if what == "video" else ImageTooLargeError
                raise error(
                    f"the request's {what}s need an estimated {total} bytes of memory to decode, "
                    f"over the {self.limit_bytes}-byte limit (--max-decode-bytes-per-request); "
                    f"send fewer or smaller {what}s",
                    param=f"{what}_url",
                )
            self.used_bytes = total


class _Waiter:
    """One queued reservation; `wake` is called (under the gate's lock) to grant it, and says
    whether anyone is still there to take it."""

    __slots__ = ("nbytes", "granted", "wake")

    def __init__(self, nbytes: int, wake: Callable[[], bool]) -> None:
        self.nbytes = nbytes
        self.granted = False
        self.wake = wake


class DecodeMemoryGate:
    """The server-wide cap on the estimated bytes of decoded images alive at once (0: no cap).

    A decode reserves its estimate after the image header is read and before any pixel buffer
    exists, and keeps it while the decoded image lives (`hold_until_collected`): the buffers
    are only given back when the image is garbage, not when decoding returns. Waiters are
    served first come, first served (a release hands the room to the head of the queue, so a
    large decode is never starved by a stream of small ones); each waits at most
    `wait_timeout_s`, then fails with DecodeBusyError (503, retry).

    Thread-safe. `reserve` blocks its thread; the server awaits `areserve` on the event loop
    instead, so that waiting decodes never hold the threads that processing (which frees
    decoded images) needs.
    """

    def __init__(self, capacity_bytes: int, wait_timeout_s: float) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 (0: no cap), got {capacity_bytes}")
        if wait_timeout_s <= 0:
            raise ValueError(f"wait_timeout_s must be positive, got {wait_timeout_s}")
        self.capacity_bytes = capacity_bytes
        self.wait_timeout_s = wait_timeout_s
        self.in_use_bytes = 0
        self._waiters: deque[_Waiter] = deque()
        self._lock = threading.Lock()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def try_reserve(self, nbytes: int) -> Release | None:
        """Take `nbytes` if they fit now and nobody is queued before; None otherwise."""
        waiter = self._enqueue(nbytes, lambda: False, queue=False)
        return None if waiter is not None else _OnceRelease(self, nbytes)

    def reserve(self, nbytes: int) -> Release:
        """Wait (FIFO, bounded) until `nbytes` fit and take them; returns their release."""
        event = threading.Event()

        def wake() -> bool:
            event.set()
            return True

        waiter = self._enqueue(nbytes, wake)
        if waiter is not None and not event.wait(self.wait_timeout_s) and not self._leave(waiter):
            raise self._busy_error()
        return _OnceRelease(self, nbytes)

    async def areserve(self, nbytes: int) -> Release:
        """`reserve` for the event loop: the wait holds no thread."""
        loop = asyncio.get_running_loop()
        granted = loop.create_future()

        def wake() -> bool:
            try:
                loop.call_soon_threadsafe(lambda: granted.done() or granted.set_result(None))
            except RuntimeError:  # that loop is closed: nobody will use the room
                return False
            return True

        waiter = self._enqueue(nbytes, wake)
        if waiter is not None:
            try:
                await asyncio.wait_for(granted, self.wait_timeout_s)
            except TimeoutError:
                if not self._leave(waiter):
                    raise self._busy_error() from None
            except asyncio.CancelledError:
                if self._leave(waiter):
                    self._release(nbytes)  # granted just as the caller went away
                raise
        return _OnceRelease(self, nbytes)

    def _enqueue(
        self, nbytes: int, wake: Callable[[], bool], *, queue: bool = True
    ) -> _Waiter | None:
        """Take the bytes now (None) or return a waiter for them, queued unless `queue` is off."""
        cap = self.capacity_bytes
        if cap and nbytes > cap:
            raise ImageTooLargeError(
                f"the image needs an estimated {nbytes} bytes of memory to decode, over the "
                f"{cap}-byte server-wide limit (--max-inflight-decode-bytes); downscale it",
                param="image_url",
            )
        with self._lock:
            if not self._waiters and (not cap or self.in_use_bytes + nbytes <= cap):
                self.in_use_bytes += nbytes
                return None
            waiter = _Waiter(nbytes, wake)
            if queue:
                self._waiters.append(waiter)
            return waiter

    def _leave(self, waiter: _Waiter) -> bool:
        """A waiter stops waiting; True if it was granted in the meantime (it owns the bytes)."""
        with self._lock:
            if waiter.granted:
                return True
            self._waiters.remove(waiter)
            self._grant()  # the next in line may fit now
            return False

    def _busy_error(self) -> DecodeBusyError:
        return DecodeBusyError(
            f"the server is busy decoding other images (waited {self.wait_timeout_s:g} s for "
            "decode memory); retry shortly"
        )

    def _grant(self) -> None:
        """Hand room to waiters from the head of the queue while they fit (lock held)."""
        cap = self.capacity_bytes
        while self._waiters and (not cap or self.in_use_bytes + self._waiters[0].nbytes <= cap):
            waiter = self._waiters.popleft()
            if waiter.wake():
                self.in_use_bytes += waiter.nbytes
                waiter.granted = True

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.in_use_bytes -= nbytes
            self._grant()

    def check_integrity(self) -> None:
        with self._lock:
            assert self.in_use_bytes >= 0, "released more than was reserved"
            assert not self.capacity_bytes or self.in_use_bytes <= self.capacity_bytes
            assert all(not w.granted for w in self._waiters), "a granted waiter still queued"


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
