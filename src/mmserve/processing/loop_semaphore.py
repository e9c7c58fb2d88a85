"""A semaphore for whichever event loop is running: asyncio's belongs to one loop."""

from __future__ import annotations

import asyncio


class LoopSemaphore:
    """`count` slots, as an `asyncio.Semaphore` of the running event loop.

    An asyncio.Semaphore belongs to the loop that first waits on it. A server has one loop, but
    a caller may drive the same object from successive `asyncio.run()` calls (tests, scripts):
    a new loop gets a new semaphore (the old loop's waiters are gone with it).
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self._current: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def get(self) -> asyncio.Semaphore:
        """The running loop's semaphore (call on that loop)."""
        loop = asyncio.get_running_loop()
        if self._current is None or self._current[0] is not loop:
            self._current = (loop, asyncio.Semaphore(self.count))
        return self._current[1]
