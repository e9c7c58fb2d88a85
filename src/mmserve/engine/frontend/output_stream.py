"""One request's stream of outputs, from the engine thread to the request's event loop."""

from __future__ import annotations

import asyncio
import collections
import contextlib

from mmserve.engine.frontend.outputs import OutputKind, RequestOutput, merge_update


class OutputStream:
    """Delivers one request's outputs from the engine thread to its event loop.

    Updates that arrive while the request's reader is busy (writing the last chunk, or waiting
    for a core) are merged into one (`merge_update`): a server that falls behind sends fewer,
    larger chunks instead of falling further behind, as vLLM's output collector does. An
    error is never merged: it comes after the updates before it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, kind: OutputKind) -> None:
        self.loop = loop
        self.kind = kind
        self._items: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """From any thread."""
        # RuntimeError: the client's loop is closed, nobody is listening any more
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.push, item)

    def push(self, item: RequestOutput | BaseException) -> None:
        """On the stream's loop."""
        last = self._items[-1] if self._items else None
        if isinstance(last, RequestOutput) and isinstance(item, RequestOutput):
            self._items[-1] = merge_update(last, item, self.kind)
        else:
            self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()
