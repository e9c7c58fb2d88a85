"""The engine thread's wait for outputs ends when a request is ready to be sent: a `Wakeup` set
from another thread ends a poll at once, sets coalesce, and a set after close does nothing."""

from __future__ import annotations

import threading

import zmq

from mmserve.engine.frontend.wakeup import Wakeup, wait_for

FOREVER_MS = 600_000  # a poll that only a wake-up or a message can end within the test
JOIN_S = 60.0


def _pair(ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://outputs")
    push.connect("inproc://outputs")
    return pull, push


def test_a_set_from_another_thread_ends_the_wait() -> None:
    ctx = zmq.Context()
    pull, push = _pair(ctx)
    wakeup = Wakeup()
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    poller.register(wakeup.fd, zmq.POLLIN)
    results: list[bool] = []
    waiter = threading.Thread(
        target=lambda: results.append(wait_for(poller, pull, wakeup, FOREVER_MS))
    )
    waiter.start()
    wakeup.set()
    waiter.join(JOIN_S)
    assert not waiter.is_alive() and results == [False]  # woken, no message

    # the wake-up was consumed: the next wait ends only with a message, which it reports
    push.send(b"outputs")
    assert wait_for(poller, pull, wakeup, FOREVER_MS) is True
    assert pull.recv() == b"outputs"
    for sock in (pull, push):
        sock.close(linger=0)
    ctx.term()
    wakeup.close()


def test_sets_coalesce_and_a_set_after_close_is_ignored() -> None:
    wakeup = Wakeup()
    poller = zmq.Poller()
    poller.register(wakeup.fd, zmq.POLLIN)
    for _ in range(100_000):  # more than a pipe holds: a full pipe is already readable
        wakeup.set()
    assert dict(poller.poll(0)) == {wakeup.fd: zmq.POLLIN}
    wakeup.clear()
    assert poller.poll(0) == []
    wakeup.close()
    wakeup.set()  # the engine thread may wake a client that has shut down
    wakeup.close()
