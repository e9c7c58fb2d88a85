"""A tensor-parallel rank's process: join the group, start the Worker, run the steps it is sent.

Started by `launch.spawn_rank` (the engine core on node 0, `serve --headless` elsewhere) with
its `WorkerConfig` as JSON on stdin. It subscribes to the executor's steps first (so the
executor, which counts subscriptions, never publishes into the void), joins the group, loads
its shard and says `WorkerReady`; then every step runs in the order sent, and each rank says
`WorkerStepDone` (rank 0's carries the answer).

It exits 0 on `WorkerShutdown`; non-zero, after telling the executor why (`WorkerFailed`),
when start-up or a step raises (a step that raised on one rank may have left the ranks apart:
no later step can be trusted), when its parent is gone, or when it loses the executor's
connection (node 0 gone; ZMQ heartbeats notice a silent peer too).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from mmserve.execution.compile import CompileReport
from mmserve.execution.model_runner import ModelRunner
from mmserve.execution.parallel.launch import decode_worker_config
from mmserve.execution.parallel.rendezvous import join_group, leave_group
from mmserve.execution.worker import Worker
from mmserve.layers.parallel import TPGroup
from mmserve.metrics import MODALITY_COUNTERS, EngineMetrics
from mmserve.wire import codec
from mmserve.wire.executor import (
    WorkerAddItems,
    WorkerFailed,
    WorkerFreeItems,
    WorkerReady,
    WorkerShutdown,
    WorkerStep,
    WorkerStepDone,
)

logger = logging.getLogger("mmserve.tp_worker")

PARENT_CHECK_MS = 500
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000
# The encoder counters rank 0 reports with each answer (the engine's metrics mirror them).
REPORTED_COUNTERS = ("encoder_items_encoded", "encoder_forward_calls")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mmserve-tp-worker")
    for name in ("rank", "size", "local-rank", "num-local-ranks", "master-port", "parent-pid"):
        p.add_argument(f"--{name}", type=int, required=True)
    for name in ("master-addr", "steps", "answers"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--timeout", type=float, required=True, help="the rendezvous's, in seconds")
    p.add_argument("--log-level", default="INFO")
    ns = p.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level,
        format=f"%(asctime)s %(levelname)s (TP rank {ns.rank}) %(name)s: %(message)s",
    )
    config = decode_worker_config(sys.stdin.buffer.read())
    ctx = zmq.Context()
    steps = ctx.socket(zmq.SUB)
    answers = ctx.socket(zmq.PUSH)
    steps.setsockopt(zmq.RCVHWM, 0)
    answers.setsockopt(zmq.SNDHWM, 0)
    steps.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    steps.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    monitor = steps.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    steps.setsockopt(zmq.SUBSCRIBE, b"")
    steps.connect(ns.steps)
    answers.connect(ns.answers)
    try:
        return _run(ns, config, steps, answers, monitor)
    finally:
        steps.disable_monitor()
        monitor.close(linger=0)
        answers.close(linger=2000)  # let the last answer or WorkerFailed leave
        steps.close(linger=0)
        ctx.term()


def _run(ns, config, steps: zmq.Socket, answers: zmq.Socket, monitor: zmq.Socket) -> int:  # noqa: ANN001
    rank = ns.rank

    def fail(reason: str) -> int:
        logger.error("rank %d stops: %s", rank, reason)
        answers.send_multipart(codec.encode(WorkerFailed(rank, reason)))
        return 1

    try:
        if config.device.type == "cuda":
            config = dataclasses.replace(config, device=torch.device("cuda", ns.local_rank))
            torch.cuda.set_device(config.device)
        elif "OMP_NUM_THREADS" not in os.environ:  # the node's cores shared by its ranks
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // ns.num_local_ranks))
        group = join_group(
            rank,
            ns.size,
            master_addr=ns.master_addr,
            master_port=ns.master_port,
            timeout_s=ns.timeout,
            device=config.device,
        )
        metrics = EngineMetrics()
        started = Worker(config, metrics, tp=group).start()
    except Exception as exc:  # noqa: BLE001 - said to the executor, which stops the engine
        logger.exception("start-up failed")
        return fail(f"start-up failed: {type(exc).__name__}: {exc}")
    answers.send_multipart(
        codec.encode(
            WorkerReady(
                rank,
                started.num_blocks,
                started.bytes_per_block,
                started.attention_backend,
                started.layer_ops,
                started.encoder_cuda_graph,
                started.cuda_graph_sizes,
                *_compile_fields(started.compiled),
            )
        )
    )
    try:
        loop = StepLoop(started.runner, group, answers, metrics)
        return loop.run(steps, monitor, lambda: os.getppid() == ns.parent_pid, fail)
    finally:
        leave_group()


def _compile_fields(report: CompileReport | None) -> tuple[float | None, int, str]:
    if report is None:
        return None, 0, ""
    return report.seconds, report.num_graphs, str(report.cache_dir)


class StepLoop:
    """Apply what the executor sends, in order, until told to stop."""

    def __init__(
        self, runner: ModelRunner, group: TPGroup, answers: zmq.Socket, metrics: EngineMetrics
    ) -> None:
        self.runner = runner
        self.group = group
        self.answers = answers
        self.metrics = metrics

    def run(self, steps: zmq.Socket, monitor: zmq.Socket, parent_alive, fail) -> int:  # noqa: ANN001
        poller = zmq.Poller()
        poller.register(steps, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            events = dict(poller.poll(PARENT_CHECK_MS))
            if not parent_alive():
                return fail("its parent process is gone")
            if monitor in events:
                recv_monitor_message(monitor)
                return fail("lost the connection to the engine core (node 0)")
            if steps not in events:
                continue
            msg = codec.decode(steps.recv_multipart(copy=False))
            try:
                if self.apply(msg):
                    logger.info("shutdown requested")
                    return 0
            except Exception as exc:  # noqa: BLE001 - the ranks may now differ: the engine stops
                logger.exception("a step failed")
                return fail(f"{type(exc).__name__} in a step: {exc}")

    def apply(self, msg: codec.Message) -> bool:
        """Apply one message; True for a shutdown."""
        if isinstance(msg, WorkerStep):
            output = self.runner.execute(msg.scheduler_output, msg.grammar_output)
            self.answers.send_multipart(codec.encode(self._done(msg.step_id, output)))
        elif isinstance(msg, WorkerAddItems):
            self.runner.add_mm_data(msg.request_id, {**msg.remote_items, **msg.encoder_inputs})
        elif isinstance(msg, WorkerFreeItems):
            self.runner.free_mm_data(msg.request_ids)
        elif isinstance(msg, WorkerShutdown):
            return True
        else:
            raise TypeError(f"a {type(msg).__name__} is not a message for a TP worker")
        return False

    def _done(self, step_id: int, output) -> WorkerStepDone:  # noqa: ANN001
        """Rank 0 answers for the group (it sampled; the others' outputs are the same tokens
        by broadcast); the others only say they finished."""
        rank = self.group.rank
        if not self.group.is_first:
            return WorkerStepDone(rank, step_id)
        snap = self.metrics.snapshot()
        return WorkerStepDone(
            rank,
            step_id,
            output,
            counters={name: snap.counters[name] for name in REPORTED_COUNTERS},
            modality_counters={
                name: dict(snap.modality_counters[name])
                for name in REPORTED_COUNTERS
                if name in MODALITY_COUNTERS
            },
        )


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: everything is released by now; a normal interpreter exit then waits seconds on
    # torch.distributed's TCPStore teardown (measured: 7-10 s on CPU), which would hold up
    # every engine shutdown.
    os._exit(code)
