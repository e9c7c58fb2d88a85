"""The engine-core process: scheduler and model, fed over ZMQ by the API process.

Started by `engine.frontend.core_client.CoreClient` as
`python -m mmserve.engine.core.process --input ADDR --output ADDR --parent-pid PID --log-level
LEVEL`, with the EngineConfig (the engine's settings only, never the HTTP server's) as JSON on
stdin. It connects a PULL socket to the API's requests and a PUSH socket to its outputs, loads
the model, says
`EngineCoreReady`, then loops: take every waiting message, run one step, send its outputs.

It never decides its own lifetime except to die: it stops on `EngineCoreShutdown`, when its
parent is gone, or when the core is dead (after telling the API why, with `EngineDead`).
SIGINT is ignored (a terminal's Ctrl-C reaches the whole group; the API process drains first).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable

import msgspec
import torch
import zmq

from mmserve.config.engine import EngineConfig
from mmserve.config.torch_device import resolve_device
from mmserve.cpu_threads import engine_cpu_threads, usable_cpus
from mmserve.engine.core.build import build_core
from mmserve.engine.core.engine_core import EngineCore
from mmserve.engine.shape import resolve_shape
from mmserve.errors import EngineDeadError, FailureKind, MMServeError, RequestFailure
from mmserve.metrics import CORE_COUNTERS, CORE_GAUGES, EngineMetrics, SchedulerStats
from mmserve.updates import RequestStatus, RequestUpdate
from mmserve.wire import codec
from mmserve.wire.common import WireError
from mmserve.wire.engine_core import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreShutdown,
    EngineDead,
)

logger = logging.getLogger("mmserve.engine_core")

# While idle, how often to look whether the API process is still there (busy: every step).
PARENT_CHECK_MS = 500


class CoreLoop:
    """Drives one EngineCore from its sockets; `run` returns the process's exit code."""

    def __init__(
        self,
        core: EngineCore,
        inbox: zmq.Socket,
        outbox: zmq.Socket,
        parent_alive: Callable[[], bool],
    ) -> None:
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.parent_alive = parent_alive
        self._last_stats: SchedulerStats | None = None

    def run(self) -> int:
        core = self.core
        while True:
            if not self.parent_alive():  # busy or not: nobody would read what it computes
                logger.error("the API process is gone; the engine core stops")
                return 1
            busy = core.has_unfinished_requests()
            if self.inbox.poll(0 if busy else PARENT_CHECK_MS):
                failed, keep_going = self._drain()
                stats = self._stats()  # an abort changes them, and the core may now go idle
                if failed or stats is not None:
                    self._send(EngineCoreOutputs(failed, stats))
                if not keep_going:
                    logger.info("shutdown requested; the engine core stops")
                    return 0
            try:
                if not core.has_unfinished_requests():
                    core.check_health()  # a TP worker may die while nothing runs
                    continue
                updates = core.step()
            except EngineDeadError as exc:
                self._send(EngineDead(exc.reason))
                return 1
            self._send(EngineCoreOutputs(updates, self._stats()))

    def _drain(self) -> tuple[list[RequestUpdate], bool]:
        """Apply every waiting message; returns the outputs of requests refused at once, and
        False once a shutdown was asked for."""
        failed: list[RequestUpdate] = []
        while True:
            try:
                frames = self.inbox.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return failed, True
            try:
                msg = codec.decode(frames)
            except WireError as exc:
                # Only a bug in the API process sends these; which request it was is unknown.
                logger.error("dropped a malformed message: %s", exc)
                continue
            if isinstance(msg, EngineCoreRequest):
                out = self._add(msg)
                if out is not None:
                    failed.append(out)
            elif isinstance(msg, EngineCoreAbort):
                self.core.finish_requests(msg.request_ids, RequestStatus.FINISHED_ABORTED)
            elif isinstance(msg, EngineCoreShutdown):
                return failed, False
            else:
                logger.error("dropped a %s: not a message for the engine core", type(msg).__name__)

    def _add(self, msg: EngineCoreRequest) -> RequestUpdate | None:
        """Add the request the API process admitted; a refusal (a grammar this engine cannot
        compile, a bug) is its final update."""
        try:
            self.core.add_request(
                msg.request_id, msg.prompt(), msg.sampling_params, cache_salt=msg.cache_salt
            )
        except EngineDeadError:
            raise
        except MMServeError as exc:
            failure = RequestFailure(str(exc), FailureKind.REQUEST, getattr(exc, "param", None))
        except Exception:  # noqa: BLE001 - a bug met by this request: it fails alone
            logger.exception("request %s: add failed", msg.request_id)
            failure = RequestFailure("internal error adding the request", FailureKind.INTERNAL)
        else:
            return None
        return RequestUpdate(msg.request_id, [], RequestStatus.FINISHED_ERROR, error=failure)

    def _stats(self) -> SchedulerStats | None:
        """The core's stats when they changed since the last ones sent, else None."""
        snap = self.core.metrics.snapshot()
        stats = msgspec.structs.replace(
            self.core.scheduler.make_stats(),
            counters={name: snap.counters[name] for name in CORE_COUNTERS},
            gauges={name: snap.gauges[name] for name in CORE_GAUGES},
            modality_counters={k: dict(v) for k, v in snap.modality_counters.items()},
            labelled_counters={k: dict(v) for k, v in snap.labelled_counters.items()},
        )
        if stats == self._last_stats:
            return None
        self._last_stats = stats
        return stats

    def _send(self, msg: codec.Message) -> None:
        self.outbox.send_multipart(codec.encode(msg), copy=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmserve-engine-core")
    parser.add_argument("--input", required=True, help="ZMQ address of the API's requests")
    parser.add_argument("--output", required=True, help="ZMQ address of the API's outputs")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", default="INFO", help="the API process's log level")
    ns = parser.parse_args(argv)
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    logging.basicConfig(
        level=ns.log_level,
        format="%(asctime)s %(levelname)s (engine core) %(name)s: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    outbox = ctx.socket(zmq.PUSH)
    # No high-water mark: the loop must never block on a send (see core_client.py).
    inbox.setsockopt(zmq.RCVHWM, 0)
    outbox.setsockopt(zmq.SNDHWM, 0)
    inbox.connect(ns.input)
    outbox.connect(ns.output)
    try:
        return _serve(config, inbox, outbox, ns.parent_pid)
    finally:
        outbox.close(linger=2000)  # let EngineDead / the last outputs leave
        inbox.close(linger=0)
        ctx.term()


def _serve(config: EngineConfig, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> int:
    try:
        _set_intra_op_threads(config, resolve_device(config.device.device).type)
        core, resolved = build_core(config, resolve_shape(config), EngineMetrics())
    except Exception as exc:  # noqa: BLE001 - reported to the API process, which exits
        logger.exception("the engine core failed to start")
        outbox.send_multipart(codec.encode(EngineDead(f"start-up failed: {exc}")))
        return 1
    ready = EngineCoreReady(resolved, core.scheduler.scheduler_config)
    outbox.send_multipart(codec.encode(ready))
    loop = CoreLoop(core, inbox, outbox, lambda: os.getppid() == parent_pid)
    try:
        return loop.run()
    except Exception as exc:  # noqa: BLE001 - a bug in this loop: the API must hear of it
        logger.exception("the engine core loop crashed")
        outbox.send_multipart(codec.encode(EngineDead(f"{type(exc).__name__} in its loop")))
        return 1
    finally:
        core.shutdown()


def _set_intra_op_threads(config: EngineConfig, device_type: str) -> None:
    """On a CPU without --cpu-threads (which build_core applies, in-process engines too):
    engine_cpu_threads's share (cpu_threads.py: every core with sleeping idle
    threads, split between the replicas)."""
    if config.device.cpu_threads is not None or device_type != "cpu":
        return
    num_cpus = usable_cpus()
    threads = engine_cpu_threads(config.parallel.data_parallel_size, os.environ, num_cpus)
    torch.set_num_threads(threads)
    logger.info(
        "%d intra-op threads (%d CPUs, %d engine process(es), OMP_WAIT_POLICY=%s)",
        threads,
        num_cpus,
        config.parallel.data_parallel_size,
        os.environ.get("OMP_WAIT_POLICY", "unset"),
    )


if __name__ == "__main__":
    sys.exit(main())
