"""Wakeup: a flag one thread sets to end another thread's wait on a ZMQ poller.

The engine thread waits for the engine process's outputs. A request the event loop hands it
meanwhile must be sent at once, not after the outputs of the step in progress arrive and are
processed: by then the engine process has started its next step, and the request would wait
for that whole step too. The wait therefore polls the output socket and this pipe together, and
`set` (any thread) makes the pipe readable.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

import zmq


class Wakeup:
    """A self-pipe for `zmq.Poller`: `set` from any thread, `clear` from the waiting one."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        # `set` and `close` under one lock: a set after close must not write to a descriptor
        # number the process has since reused.
        self._lock = threading.Lock()
        self._is_closed = False
        # A client dropped without shutdown must not leak the two descriptors.
        self._finalizer = weakref.finalize(self, _close_pipe, self._read_fd, self._write_fd)

    @property
    def fd(self) -> int:
        """Readable while set: register it with a poller for POLLIN."""
        return self._read_fd

    def set(self) -> None:
        with self._lock:
            if self._is_closed:  # the waiter is gone
                return
            # BlockingIOError: the pipe is full, so it is readable already
            with contextlib.suppress(BlockingIOError):
                os.write(self._write_fd, b"\0")

    def clear(self) -> None:
        """Consume every pending `set` (they coalesce into one wake-up)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read_fd, 4096):
                pass

    def close(self) -> None:
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            self._finalizer()


def _close_pipe(read_fd: int, write_fd: int) -> None:
    os.close(read_fd)
    os.close(write_fd)


def wait_for(poller: zmq.Poller, socket: zmq.Socket, wakeup: Wakeup, timeout_ms: int) -> bool:
    """Wait until `socket` has a message, `wakeup` is set, or timeout_ms passed; True when the
    socket has a message. A wake-up is consumed."""
    events = dict(poller.poll(timeout_ms))
    if wakeup.fd in events:
        wakeup.clear()
    return socket in events
