"""CoreClient: an `EngineCore` in an engine process, seen from the API process.

Requests leave over a ZMQ PUSH socket as `EngineCoreRequest`s and updates come back over a
PULL socket as `EngineCoreOutputs`, both on ipc:// sockets in a private temporary directory
(the API process binds, the engine process connects). Admission happens before a request
reaches the client (`LLMEngine.add_request`, against this client's configs), so a request that
could never run is refused with the same typed error as in-process. The client watches the
process, so a dead engine is an `EngineDeadError` within `STEP_POLL_MS` of a step, never a
hang.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterable, Mapping

import msgspec
import zmq

from mmserve.config.engine import EngineConfig
from mmserve.config.resolved import ResolvedConfig
from mmserve.config.scheduler import CacheConfig, SchedulerConfig
from mmserve.cpu_threads import WAIT_POLICY_ENV
from mmserve.engine.frontend.wakeup import Wakeup, wait_for
from mmserve.errors import EngineDeadError
from mmserve.metrics import EngineMetrics, record_scheduler_stats
from mmserve.multimodal import ProcessedPrompt
from mmserve.sampling_params import SamplingParams
from mmserve.structured_output.compiler import check_structured_output
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

logger = logging.getLogger(__name__)

# How long one `step` waits for outputs before it looks at the process and returns: the bound
# on noticing a dead engine. A new request does not wait for it: `wake` ends the wait at once.
STEP_POLL_MS = 20
READY_POLL_MS = 200
SHUTDOWN_WAIT_S = 10.0


class CoreClient:
    """`CoreLike` over an engine process. One thread drives it (the engine loop's)."""

    def __init__(
        self,
        proc: subprocess.Popen,
        ctx: zmq.Context,
        requests: zmq.Socket,
        outputs: zmq.Socket,
        socket_dir: str,
        *,
        metrics: EngineMetrics,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
    ) -> None:
        self.proc = proc
        self._ctx = ctx
        self._requests = requests
        self._outputs = outputs
        self._socket_dir = socket_dir
        self.metrics = metrics
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self._unfinished: set[str] = set()
        self.dead_reason: str | None = None
        self._closed = False
        self._wakeup = Wakeup()
        self._poller = zmq.Poller()
        self._poller.register(outputs, zmq.POLLIN)
        self._poller.register(self._wakeup.fd, zmq.POLLIN)
        # An LLM that is dropped without shutdown() must not leave its engine process behind.
        self._finalizer = weakref.finalize(self, _kill, proc, socket_dir)

    @classmethod
    def start(
        cls, config: EngineConfig, metrics: EngineMetrics, *, env: dict[str, str] | None = None
    ) -> tuple[CoreClient, ResolvedConfig]:
        """Start an engine process for `config` and wait until it has loaded the model.

        `env`: variables set for the engine process on top of this one's (a data-parallel
        replica's CUDA_VISIBLE_DEVICES). What the engine resolved (device, dtype, KV blocks,
        the scheduler's budgets) comes back in its ready message: this process admits requests
        by it and never resolves a device itself (it does not import torch).
        """
        socket_dir = tempfile.mkdtemp(prefix="mmserve-core-")
        requests_addr = f"ipc://{socket_dir}/requests"
        outputs_addr = f"ipc://{socket_dir}/outputs"
        ctx = zmq.Context()
        requests = ctx.socket(zmq.PUSH)
        outputs = ctx.socket(zmq.PULL)
        # No high-water mark: a send must never block the engine thread (what is queued is
        # bounded by the server's own limits: requests in flight, decode memory).
        requests.setsockopt(zmq.SNDHWM, 0)
        outputs.setsockopt(zmq.RCVHWM, 0)
        requests.bind(requests_addr)
        outputs.bind(outputs_addr)
        command = [
            sys.executable,
            "-m",
            "mmserve.engine.core.process",
            "--input",
            requests_addr,
            "--output",
            outputs_addr,
            "--parent-pid",
            str(os.getpid()),
            "--log-level",
            _log_level(),
        ]
        # A session of its own: a terminal's Ctrl-C or a SIGTERM to the group reaches only
        # the API process, which drains and then stops the engine.
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            start_new_session=True,
            env=engine_env(os.environ, env),
        )
        assert proc.stdin is not None
        proc.stdin.write(msgspec.json.encode(config))
        proc.stdin.close()
        try:
            ready = _wait_ready(proc, outputs)
        except BaseException:
            _kill(proc, socket_dir)
            requests.close(linger=0)
            outputs.close(linger=0)
            ctx.term()
            raise
        resolved = ready.config
        cache_config = dataclasses.replace(config.cache, num_blocks=resolved.num_kv_blocks)
        client = cls(
            proc,
            ctx,
            requests,
            outputs,
            socket_dir,
            metrics=metrics,
            scheduler_config=ready.scheduler,
            cache_config=cache_config,
        )
        logger.info("engine core ready in process %d", proc.pid)
        return client, resolved

    # ------------------------------------------------------------------------------ CoreLike

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> None:
        self.check_alive()
        if request_id in self._unfinished:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if params.structured_outputs is not None:  # refused here, as in-process, not later
            check_structured_output(params.structured_outputs)
        msg = EngineCoreRequest.of(
            request_id, prompt, params, arrival_time_s=time.monotonic(), cache_salt=cache_salt
        )
        self._send(msg)
        self._unfinished.add(request_id)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        ids = [i for i in request_ids if i in self._unfinished]
        if not ids or self.dead_reason is not None:
            return
        self._unfinished.difference_update(ids)
        self._send(EngineCoreAbort(ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    @property
    def num_unfinished_requests(self) -> int:
        """The requests sent and not finished: a data-parallel replica's load."""
        return len(self._unfinished)

    @property
    def outputs_socket(self) -> zmq.Socket:
        """The socket the engine's outputs arrive on (to wait on several clients at once)."""
        return self._outputs

    def step(self, poll_ms: int = STEP_POLL_MS) -> list[RequestUpdate]:
        """The updates of the steps the engine finished since the last call; [] after
        `poll_ms` without any, or at once after a `wake`. Raises only EngineDeadError."""
        self.check_alive()
        if not wait_for(self._poller, self._outputs, self._wakeup, poll_ms):
            return []
        updates: list[RequestUpdate] = []
        while True:
            try:
                frames = self._outputs.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return updates
            updates.extend(self._receive(frames))

    def wake(self) -> None:
        """End a `step` waiting for outputs now (from any thread): the engine loop has a
        request or an abort to send, which must reach the engine process before its next
        step starts, not after the outputs of the current one."""
        self._wakeup.set()

    def check_alive(self) -> None:
        """Raise EngineDeadError if the engine has died. With no request unfinished, also
        take in what it sent since (stats after the last abort; outputs of aborted requests,
        which nobody waits for), so idle gauges are not stale."""
        if self.dead_reason is None and not self._unfinished:
            while self._outputs.poll(0):
                self._receive(self._outputs.recv_multipart(copy=False))
        if self.dead_reason is None and self.proc.poll() is not None:
            self._die(f"the engine process exited ({_exit_status(self.proc.returncode)})")
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def shutdown(self) -> None:
        """Ask the engine to stop, wait for it (then kill it), release sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            try:
                self._requests.send_multipart(codec.encode(EngineCoreShutdown()), flags=zmq.NOBLOCK)
                self.proc.wait(SHUTDOWN_WAIT_S)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                logger.warning("the engine process did not stop in time; killing it")
        self._requests.close(linger=0)
        self._outputs.close(linger=0)
        self._ctx.term()
        self._wakeup.close()
        self._finalizer()  # kills the process if still there, removes the socket directory

    # --------------------------------------------------------------------------- internals

    def _receive(self, frames: list) -> list[RequestUpdate]:
        try:
            msg = codec.decode(frames)
        except WireError as exc:
            # The stream can no longer be trusted: which outputs were lost is unknown.
            self._die(f"a malformed message from the engine process: {exc}")
            raise EngineDeadError(self.dead_reason or "") from exc
        if isinstance(msg, EngineDead):
            self._die(f"the engine process died: {msg.reason}")
            raise EngineDeadError(self.dead_reason or "")
        if not isinstance(msg, EngineCoreOutputs):
            logger.error("ignored a %s from the engine process", type(msg).__name__)
            return []
        if msg.stats is not None:
            record_scheduler_stats(self.metrics, msg.stats)
        updates = msg.outputs
        for update in updates:
            if update.finished:
                self._unfinished.discard(update.request_id)
        return updates

    def _send(self, msg: codec.Message) -> None:
        self._requests.send_multipart(codec.encode(msg), copy=False)

    def _die(self, reason: str) -> None:
        if self.dead_reason is None:
            logger.error("%s", reason)
            self.dead_reason = reason
            self._unfinished.clear()


def _wait_ready(proc: subprocess.Popen, outputs: zmq.Socket) -> EngineCoreReady:
    while True:
        if outputs.poll(READY_POLL_MS):
            msg = codec.decode(outputs.recv_multipart())
            if isinstance(msg, EngineCoreReady):
                return msg
            if isinstance(msg, EngineDead):
                raise RuntimeError(f"the engine process failed to start: {msg.reason}")
            raise RuntimeError(f"the engine process sent a {type(msg).__name__} before ready")
        if proc.poll() is not None:
            raise RuntimeError(
                f"the engine process exited before it was ready "
                f"({_exit_status(proc.returncode)}); its log is above"
            )


def _exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by signal {-code}"
    return f"exit code {code}"


def _kill(proc: subprocess.Popen, socket_dir: str) -> None:
    if proc.poll() is None:
        proc.kill()
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            logger.error("engine process %d did not die after SIGKILL", proc.pid)
    shutil.rmtree(socket_dir, ignore_errors=True)


def _log_level() -> str:
    """The engine process logs as this process does (`serve --log-level`); an API that
    configured no logging (the offline LLM) gets the engine's start-up story at info."""
    root = logging.getLogger()
    return logging.getLevelName(root.level) if root.handlers else "INFO"


def engine_env(parent: Mapping[str, str], extra: Mapping[str, str] | None) -> dict[str, str]:
    """The engine process's environment: the parent's, `extra` over it, and idle OpenMP threads
    that sleep (OMP_WAIT_POLICY=PASSIVE) unless either already says otherwise, so that on a CPU
    the engine may take every core (cpu_threads.py)."""
    return {**WAIT_POLICY_ENV, **parent, **(extra or {})}
