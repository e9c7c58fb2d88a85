"""Turns at the API process's CPU work: requests decode and process in arrival order.

Requests that arrive together (a burst, or a closed-loop client whose requests finish
together) all want the same CPU stages: decoding, resizing, patchifying, hashing,
tokenizing. Started all at once, they share the cores and every one of them finishes at
about the time the last one would have; the engine has nothing to start on until then.
Taking turns, at most `count` requests at a time (a server: one per CPU it may run on) in
arrival order, the first ones finish early and the engine runs their encoder and prefill
while later ones are processed: the work is the same, the early requests' first tokens come
sooner (in A/B runs at concurrency 16 on two cores the median TTFT fell by 10-15%;
benchmarks/RESULTS.md).

A turn covers the CPU stages only. A request fetches its http(s) media (and reads data:
and file media) before it queues, so a slow media server never holds a turn, and a request
that goes away while it waits leaves the queue (asyncio.Semaphore wakes waiters first come,
first served and skips cancelled ones). Only requests with images take turns: one without
media has nothing costly to order (tokenizing is microseconds), and a video's decode can take
seconds, which would hold every image request behind it (videos are bounded by the decode
workers, as before).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

from mmserve.cpu_threads import usable_cpus
from mmserve.processing.loop_semaphore import LoopSemaphore


class ProcessingTurns:
    """At most `count` requests in their CPU stages at once, the others waiting in arrival
    order (on the running event loop: `LoopSemaphore`)."""

    @classmethod
    def for_decoding(cls, decode_workers: int) -> ProcessingTurns:
        """A server's turns (decoding in `decode_workers` processes): one per CPU this process
        may run on, as many requests as can work at once without sharing a core; decoding
        in-process (the offline API, tests): one."""
        return cls(usable_cpus() if decode_workers else 1)

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"processing turns must be >= 1, got {count}")
        self.count = count
        self._slots = LoopSemaphore(count)

    @asynccontextmanager
    async def turn(self, modalities: Iterable[str] = ("image",)) -> AsyncIterator[None]:
        """Wait for a turn (first come, first served) and hold it for the block, if the
        request's items (`modalities`, one per item) are images and at least one; else go
        at once (module docstring)."""
        if set(modalities) != {"image"}:
            yield
            return
        async with self._slots.get():
            yield
