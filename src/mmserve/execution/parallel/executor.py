"""MultiprocExecutor: the engine core's executor over N tensor-parallel worker processes.

    engine core (node 0)                            ranks (node 0, and --headless nodes)
    Executor.add_mm_data / free_mm_data  --XPUB-->  WorkerAddItems / WorkerFreeItems
    Executor.execute(so, grammar)        --XPUB-->  WorkerStep(step_id, so, grammar)
                                         <--PULL--  WorkerStepDone from every rank (rank 0's
                                                    carries the answer), or WorkerFailed

Each message is encoded once (`wire.codec`, arrays as raw frames) and ZMQ's PUB fans it out.
A step is done when every rank has said so; the answer is rank 0's: it sampled and broadcast
its tokens, so the other ranks' request states advanced the same way, and only it applies the
grammar masks, logprobs, penalties and seeds.

The engine stops (execute raises, check_health raises, the engine fails every request and the
server exits) when a local rank's process has exited, a rank reports `WorkerFailed` (a rank
of a remote node that died is reported by its node's launcher), or a step is not answered by
every rank within `step_timeout_s` (a hung rank, named). No step is retried: after a failure
the ranks may hold different states.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
from collections.abc import Iterable, Mapping

import zmq

from mmserve.execution.encoder.pixels import ItemDataStore
from mmserve.metrics import EngineMetrics
from mmserve.multimodal import EncoderInput, ItemData, MultiModalFeature, RemoteItem
from mmserve.scheduling.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from mmserve.wire import codec
from mmserve.wire.common import WireError
from mmserve.wire.executor import (
    WorkerAddItems,
    WorkerFailed,
    WorkerFreeItems,
    WorkerReady,
    WorkerShutdown,
    WorkerStep,
    WorkerStepDone,
)

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often a wait looks at the local ranks' processes
SHUTDOWN_WAIT_S = 10.0


class WorkerGone(RuntimeError):
    """A rank died, failed or hung: the executor cannot compute any more."""


class MultiprocExecutor:
    """Drives the ranks; `item_data` is this side's copy of the item store (what the scheduler
    asks `holds`), kept in step with the ranks' own (see `_pass_items`)."""

    def __init__(
        self,
        size: int,
        context: zmq.Context,
        steps: zmq.Socket,
        answers: zmq.Socket,
        local_procs: Mapping[int, subprocess.Popen],
        *,
        step_timeout_s: float,
        item_data: ItemDataStore,
        metrics: EngineMetrics,
    ) -> None:
        self.size = size
        self.context = context
        self.steps = steps  # XPUB, bound
        self.answers = answers  # PULL, bound
        self.local_procs = dict(local_procs)  # global rank -> its process on this node
        self.step_timeout_s = step_timeout_s
        self.item_data = item_data
        self.metrics = metrics
        self.dead_reason: str | None = None
        self.is_shut_down = False
        self._next_step_id = 0
        # request id -> (its items, where its prefill stands): for `_pass_items`
        self._progress: dict[str, tuple[list[MultiModalFeature], int]] = {}

    # ------------------------------------------------------------------------ start-up

    def wait_until_ready(self, timeout_s: float | None = None) -> list[WorkerReady]:
        """Every rank subscribed and started; their reports in rank order. WorkerGone when a
        rank fails to start or dies first (or `timeout_s` passes)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        num_subscribed = 0
        ready: dict[int, WorkerReady] = {}
        poller = zmq.Poller()
        poller.register(self.steps, zmq.POLLIN)
        poller.register(self.answers, zmq.POLLIN)
        while num_subscribed < self.size or len(ready) < self.size:
            self._check_processes()
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(set(range(self.size)) - ready.keys())
                self._die(f"rank(s) {missing} did not start within {timeout_s:g} s")
            events = dict(poller.poll(POLL_MS))
            if self.steps in events:
                frame = self.steps.recv()
                num_subscribed += bool(frame) and frame[0] == 1
            if self.answers in events:
                msg = self._recv_answer()
                if isinstance(msg, WorkerReady):
                    ready[msg.rank] = msg
        logger.info("all %d tensor-parallel ranks are ready", self.size)
        return [ready[r] for r in range(self.size)]

    # ------------------------------------------------------------------------ Executor

    def add_mm_data(self, request_id: str, data: Mapping[str, ItemData]) -> None:
        self.item_data.add(request_id, data)
        pixels = {i: d for i, d in data.items() if isinstance(d, EncoderInput)}
        remote = {i: d for i, d in data.items() if isinstance(d, RemoteItem)}
        self._publish(WorkerAddItems(request_id, pixels, remote))

    def free_mm_data(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        self.item_data.release(ids)
        for request_id in ids:
            self._progress.pop(request_id, None)
        self._publish(WorkerFreeItems(ids))

    def execute(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        if self.is_shut_down:
            raise RuntimeError("execute after shutdown: the workers are gone")
        if self.dead_reason is not None:
            raise WorkerGone(self.dead_reason)
        step_id = self._next_step_id
        self._next_step_id += 1
        self._publish(WorkerStep(step_id, scheduler_output, grammar_output))
        output = self._wait_for_step(step_id)
        self._pass_items(scheduler_output)
        return output

    def wait_for_encoder(self, timeout_s: float) -> None:
        """No remote encoder with tensor parallelism (refused at start-up): nothing in flight."""

    def check_health(self) -> None:
        if self.is_shut_down:
            raise RuntimeError("the executor was shut down")
        if self.dead_reason is None:
            self._check_processes()
            while self.answers.poll(0):  # a WorkerFailed that came while idle
                self._recv_answer()
        if self.dead_reason is not None:
            raise WorkerGone(self.dead_reason)

    def shutdown(self) -> None:
        if self.is_shut_down:
            return
        self.is_shut_down = True
        with contextlib.suppress(zmq.ZMQError):  # gone: the ranks see their parent go
            self._publish(WorkerShutdown())
        if self.dead_reason is not None:  # the group is broken: nothing left to finish
            for proc in self.local_procs.values():
                if proc.poll() is None:
                    proc.kill()
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for rank, proc in self.local_procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("TP rank %d did not exit in %g s: killed", rank, SHUTDOWN_WAIT_S)
                proc.kill()
                proc.wait()
        self.steps.close(linger=0)
        self.answers.close(linger=0)
        self.context.term()

    # ------------------------------------------------------------------------ inside

    def _publish(self, msg: codec.Message) -> None:
        self.steps.send_multipart(codec.encode(msg), copy=False)

    def _wait_for_step(self, step_id: int) -> ModelRunnerOutput:
        deadline = time.monotonic() + self.step_timeout_s
        done: set[int] = set()
        output: ModelRunnerOutput | None = None
        while len(done) < self.size:
            self._check_processes()
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.size)) - done)
                self._die(
                    f"rank(s) {missing} did not finish step {step_id} within "
                    f"{self.step_timeout_s:g} s (--worker-step-timeout): taken as hung"
                )
            if not self.answers.poll(POLL_MS):
                continue
            msg = self._recv_answer()
            if isinstance(msg, WorkerStepDone) and msg.step_id == step_id:
                done.add(msg.rank)
                if msg.rank == 0:
                    output = msg.output
                    self._mirror_counters(msg)
        if output is None:
            self._die(f"rank 0 finished step {step_id} without its answer")
        return output

    def _recv_answer(self) -> codec.Message:
        frames = self.answers.recv_multipart(copy=False)
        try:
            msg = codec.decode(frames)
        except WireError as exc:
            self._die(f"a worker sent a malformed message: {exc}")
        if isinstance(msg, WorkerFailed):
            # NOTE: when a rank dies, the others' collectives fail with it and they report
            # first: a rank whose process is gone is the cause, so it is named.
            self._check_processes()
            self._die(f"tensor-parallel rank {msg.rank} failed: {msg.reason}")
        return msg

    def _check_processes(self) -> None:
        for rank, proc in self.local_procs.items():
            code = proc.poll()
            if code is not None:
                self._die(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")

    def _die(self, reason: str) -> None:
        if self.dead_reason is None:
            logger.error("the tensor-parallel workers cannot go on: %s", reason)
            self.dead_reason = reason
        raise WorkerGone(self.dead_reason)

    def _mirror_counters(self, msg: WorkerStepDone) -> None:
        for name, value in msg.counters.items():
            self.metrics.set_counter(name, value)
        for name, by_modality in msg.modality_counters.items():
            for modality, value in by_modality.items():
                self.metrics.set_modality_counter(name, modality, value)

    def _pass_items(self, so: SchedulerOutput) -> None:
        """What `ModelRunner.execute` does to its item store after a step, done to this
        side's copy: the items a request's prefill has passed move to the bounded part. The
        same calls in the same order as on every rank, so `holds` answers as a rank would."""
        for new in so.scheduled_new_reqs:
            self._progress[new.request_id] = (new.mm_features, new.num_computed_tokens)
        for cached in so.scheduled_cached_reqs:
            entry = self._progress.get(cached.request_id)
            if entry is not None:
                self._progress[cached.request_id] = (entry[0], cached.num_computed_tokens)
        for request_id in so.finished_req_ids | so.preempted_req_ids:
            if request_id not in so.num_scheduled_tokens:
                self._progress.pop(request_id, None)
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            entry = self._progress.get(request_id)
            if entry is not None:
                self.item_data.pass_items(request_id, entry[0], entry[1] + num_tokens)
