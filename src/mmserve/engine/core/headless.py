"""`mmserve serve --headless`: a node that runs only its tensor-parallel ranks.

Node 0 runs the API server and the engine core (whose executor drives every rank); a headless
node N starts ranks N * k .. N * k + k - 1 (k = --tensor-parallel-size / --nnodes), which
meet node 0 at --master-addr:--master-port (the rendezvous) and take their steps from the
two ports after it. This launcher then watches its ranks: when one dies it tells node 0's
executor (`WorkerFailed`: the engine stops and fails its requests), stops the others and
exits 1; when all have exited 0 (node 0 shut down) it exits 0.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading

import zmq

from mmserve.config.engine import EngineConfig
from mmserve.config.torch_device import resolve_device, resolve_dtype
from mmserve.engine.core.build import worker_config
from mmserve.engine.shape import resolve_shape
from mmserve.execution.parallel.launch import multi_node_place, spawn_rank, stop_ranks
from mmserve.wire import codec
from mmserve.wire.executor import WorkerFailed

logger = logging.getLogger("mmserve.headless")

WATCH_S = 0.5
STOP_WAIT_S = 10.0


def run_headless(config: EngineConfig, log_level: str) -> int:
    """Start this node's ranks and watch them; the exit code (0: node 0 shut them down)."""
    parallel = config.parallel
    shape = resolve_shape(config)
    device = resolve_device(config.device.device)
    dtype = resolve_dtype(config.checkpoint.dtype, device, shape.model_config.dtype)
    place = multi_node_place(parallel)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    wcfg = worker_config(config, shape, device, dtype)
    procs = {
        rank: spawn_rank(
            wcfg,
            place,
            rank=rank,
            local_rank=local_rank,
            num_local_ranks=parallel.ranks_per_node,
            log_level=log_level,
            cpu_threads=config.device.cpu_threads,
        )
        for local_rank, rank in enumerate(parallel.local_ranks)
    }
    logger.info(
        "node %d of %d: ranks %s started; node 0 at %s:%d",
        parallel.node_rank,
        parallel.nnodes,
        list(procs),
        place.master_addr,
        place.master_port,
    )
    ctx = zmq.Context()
    report = ctx.socket(zmq.PUSH)
    report.connect(place.answers_addr)
    try:
        return _watch(procs, report, stop)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        stop_ranks(list(procs.values()), STOP_WAIT_S)
        report.close(linger=2000)
        ctx.term()


def _watch(procs: dict[int, subprocess.Popen], report: zmq.Socket, stop: threading.Event) -> int:
    while not stop.wait(WATCH_S):
        codes = {rank: proc.poll() for rank, proc in procs.items()}
        failed = {rank: code for rank, code in codes.items() if code not in (None, 0)}
        if failed:
            rank, code = min(failed.items())
            reason = f"its process exited with code {code} (node of --headless)"
            logger.error("TP rank %d: %s; this node stops", rank, reason)
            report.send_multipart(codec.encode(WorkerFailed(rank, reason)))
            return 1
        if all(code == 0 for code in codes.values()):
            logger.info("every rank of this node has finished: node 0 shut down")
            return 0
    logger.info("signal received: this node's ranks stop")
    return 0
