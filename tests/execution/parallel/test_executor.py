"""MultiprocExecutor against small rank stand-ins on threads (real sockets, real messages):
a step is done when every rank says so and rank 0's answer is the step's; a rank that hangs
or fails makes execute and check_health raise, naming it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import zmq

from mmserve.execution.encoder.pixels import ItemDataStore
from mmserve.execution.parallel.executor import MultiprocExecutor, WorkerGone
from mmserve.metrics import EngineMetrics
from mmserve.scheduling.outputs import ModelRunnerOutput, SchedulerOutput
from mmserve.wire import codec
from mmserve.wire.executor import (
    WorkerFailed,
    WorkerReady,
    WorkerShutdown,
    WorkerStep,
    WorkerStepDone,
)

EMPTY = SchedulerOutput([], [], {"r": 1}, 1, {}, [], frozenset(), frozenset())


class Rank(threading.Thread):
    """Answers every step (rank 0 with token 40 + step id) until `hang` or `fail` is set."""

    def __init__(self, rank: int, steps_addr: str, answers_addr: str) -> None:
        super().__init__(daemon=True)
        self.rank = rank
        self.ctx = ctx = zmq.Context()  # its own, as a rank process has
        self.hang = threading.Event()
        self.fail = threading.Event()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(steps_addr)
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(answers_addr)

    def run(self) -> None:
        self.push.send_multipart(
            codec.encode(WorkerReady(self.rank, 8, 64, "torch", "torch", False, ()))
        )
        while True:
            msg = codec.decode(self.sub.recv_multipart())
            if isinstance(msg, WorkerShutdown):
                break
            if not isinstance(msg, WorkerStep) or self.hang.is_set():
                continue
            if self.fail.is_set():
                self.push.send_multipart(codec.encode(WorkerFailed(self.rank, "out of memory")))
                continue
            out = ModelRunnerOutput({"r": [40 + msg.step_id]}) if self.rank == 0 else None
            self.push.send_multipart(codec.encode(WorkerStepDone(self.rank, msg.step_id, out)))
        self.sub.close(linger=0)
        self.push.close(linger=1000)
        self.ctx.term()


@pytest.fixture
def group() -> Iterator[tuple[MultiprocExecutor, list[Rank]]]:
    ctx = zmq.Context()
    steps, answers = ctx.socket(zmq.XPUB), ctx.socket(zmq.PULL)
    steps.setsockopt(zmq.XPUB_VERBOSE, 1)
    steps_port = steps.bind_to_random_port("tcp://127.0.0.1")
    answers_port = answers.bind_to_random_port("tcp://127.0.0.1")
    executor = MultiprocExecutor(
        2,
        ctx,
        steps,
        answers,
        {},
        step_timeout_s=2.0,
        item_data=ItemDataStore(0),
        metrics=EngineMetrics(),
    )
    ranks = [
        Rank(r, f"tcp://127.0.0.1:{steps_port}", f"tcp://127.0.0.1:{answers_port}")
        for r in range(2)
    ]
    for r in ranks:
        r.start()
    ready = executor.wait_until_ready(timeout_s=60)
    assert [r.rank for r in ready] == [0, 1]
    yield executor, ranks
    executor.shutdown()
    for r in ranks:
        r.join(timeout=10)


def test_every_rank_answers_and_rank_0_speaks_for_the_group(group) -> None:
    executor, _ = group
    assert executor.execute(EMPTY).sampled_token_ids == {"r": [40]}
    assert executor.execute(EMPTY).sampled_token_ids == {"r": [41]}
    executor.check_health()


def test_a_hung_rank_is_named_and_the_executor_stays_dead(group) -> None:
    executor, ranks = group
    executor.execute(EMPTY)
    ranks[1].hang.set()
    with pytest.raises(WorkerGone, match=r"rank\(s\) \[1\] did not finish step 1 within 2 s"):
        executor.execute(EMPTY)
    with pytest.raises(WorkerGone, match=r"\[1\] did not finish"):
        executor.check_health()
    with pytest.raises(WorkerGone):
        executor.execute(EMPTY)


def test_a_failed_rank_stops_the_executor_with_its_reason(group) -> None:
    executor, ranks = group
    ranks[0].fail.set()
    with pytest.raises(WorkerGone, match="tensor-parallel rank 0 failed: out of memory"):
        executor.execute(EMPTY)
    with pytest.raises(WorkerGone, match="out of memory"):
        executor.check_health()
