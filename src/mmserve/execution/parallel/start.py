"""Start the tensor-parallel executor on node 0: its sockets, this node's ranks, their reports."""

from __future__ import annotations

import logging
import socket

import zmq

from mmserve.config.parallel import ParallelConfig
from mmserve.execution.encoder.pixels import ItemDataStore
from mmserve.execution.parallel.executor import MultiprocExecutor
from mmserve.execution.parallel.launch import RankPlace, multi_node_place, spawn_rank
from mmserve.execution.worker import WorkerConfig
from mmserve.metrics import EngineMetrics
from mmserve.wire.executor import WorkerReady

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def start_executor(
    config: WorkerConfig,
    parallel: ParallelConfig,
    metrics: EngineMetrics,
    log_level: str,
    cpu_threads: int | None = None,
) -> tuple[MultiprocExecutor, list[WorkerReady]]:
    """Bind the steps (XPUB) and answers (PULL) sockets, start this node's ranks and wait
    until every rank of every node is ready. WorkerGone (after stopping the local ranks) when
    one fails to start; the message names it and why."""
    ctx = zmq.Context()
    steps = ctx.socket(zmq.XPUB)
    answers = ctx.socket(zmq.PULL)
    steps.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription reaches us: we count them
    steps.setsockopt(zmq.SNDHWM, 0)  # a step is never dropped
    answers.setsockopt(zmq.RCVHWM, 0)
    if parallel.nnodes > 1:
        place = multi_node_place(parallel)
        steps.bind(f"tcp://*:{place.steps_addr.rsplit(':', 1)[1]}")
        answers.bind(f"tcp://*:{place.answers_addr.rsplit(':', 1)[1]}")
    else:
        steps_port = steps.bind_to_random_port(f"tcp://{LOOPBACK}")
        answers_port = answers.bind_to_random_port(f"tcp://{LOOPBACK}")
        place = RankPlace(
            size=parallel.tensor_parallel_size,
            master_addr=LOOPBACK,
            master_port=parallel.master_port or _free_port(),
            steps_addr=f"tcp://{LOOPBACK}:{steps_port}",
            answers_addr=f"tcp://{LOOPBACK}:{answers_port}",
            timeout_s=parallel.distributed_timeout_seconds,
        )
    procs = {
        rank: spawn_rank(
            config,
            place,
            rank=rank,
            local_rank=local_rank,
            num_local_ranks=parallel.ranks_per_node,
            log_level=log_level,
            cpu_threads=cpu_threads,
        )
        for local_rank, rank in enumerate(parallel.local_ranks)
    }
    executor = MultiprocExecutor(
        place.size,
        ctx,
        steps,
        answers,
        procs,
        step_timeout_s=parallel.worker_step_timeout,
        item_data=ItemDataStore(config.mm_reencode_cache_bytes),
        metrics=metrics,
    )
    try:
        ready = executor.wait_until_ready()
    except BaseException:
        executor.shutdown()
        raise
    return executor, ready


def _free_port() -> int:
    """A port free now on the loopback, for rank 0's rendezvous store (one node only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])
