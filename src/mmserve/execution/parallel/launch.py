"""Start a node's tensor-parallel ranks as processes, and where they meet the executor.

Each rank is `python -m mmserve.execution.parallel.worker_main` with its place (rank, size,
local rank, the rendezvous, the executor's two ZMQ addresses) as arguments and its
`WorkerConfig` as JSON on stdin: plain data, never pickle.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from mmserve.config.parallel import ANSWERS_PORT_OFFSET, STEPS_PORT_OFFSET, ParallelConfig
from mmserve.execution.worker import WorkerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankPlace:
    """Where every rank of the group meets: the rendezvous and the executor's sockets."""

    size: int
    master_addr: str
    master_port: int
    steps_addr: str  # the executor's PUB socket: steps go out
    answers_addr: str  # the executor's PULL socket: answers come back
    timeout_s: float  # the rendezvous's (--distributed-timeout-seconds)


def multi_node_place(parallel: ParallelConfig) -> RankPlace:
    """The place of a run over several nodes: ports next to --master-port (see its help)."""
    assert parallel.master_port is not None
    addr, port = parallel.master_addr, parallel.master_port
    return RankPlace(
        size=parallel.tensor_parallel_size,
        master_addr=addr,
        master_port=port,
        steps_addr=f"tcp://{addr}:{port + STEPS_PORT_OFFSET}",
        answers_addr=f"tcp://{addr}:{port + ANSWERS_PORT_OFFSET}",
        timeout_s=parallel.distributed_timeout_seconds,
    )


def encode_worker_config(config: WorkerConfig) -> bytes:
    return msgspec.json.encode(config, enc_hook=_enc_hook)


def decode_worker_config(data: bytes) -> WorkerConfig:
    return msgspec.json.decode(data, type=WorkerConfig, dec_hook=_dec_hook)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, torch.device):
        return str(obj)
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    raise TypeError(f"{type(obj).__name__} is not part of a WorkerConfig")


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is Path:
        return Path(obj)
    if type_ is torch.device:
        return torch.device(obj)
    if type_ is torch.dtype:
        dtype = getattr(torch, obj, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{obj!r} is not a torch dtype")
        return dtype
    raise TypeError(f"no decoding for {type_!r}")


def spawn_rank(
    config: WorkerConfig,
    place: RankPlace,
    *,
    rank: int,
    local_rank: int,
    num_local_ranks: int,
    log_level: str,
    cpu_threads: int | None = None,
) -> subprocess.Popen:
    """Start one rank; its parent is this process (it exits when this one is gone). With
    `cpu_threads` (--cpu-threads) the rank takes that many intra-op threads (OMP_NUM_THREADS),
    else its node's cores split between the node's ranks."""
    cmd = [
        sys.executable,
        "-m",
        "mmserve.execution.parallel.worker_main",
        f"--rank={rank}",
        f"--size={place.size}",
        f"--local-rank={local_rank}",
        f"--num-local-ranks={num_local_ranks}",
        f"--master-addr={place.master_addr}",
        f"--master-port={place.master_port}",
        f"--steps={place.steps_addr}",
        f"--answers={place.answers_addr}",
        f"--timeout={place.timeout_s}",
        f"--parent-pid={os.getpid()}",
        f"--log-level={log_level}",
    ]
    env = None if cpu_threads is None else {**os.environ, "OMP_NUM_THREADS": str(cpu_threads)}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
    assert proc.stdin is not None
    proc.stdin.write(encode_worker_config(config))
    proc.stdin.close()
    logger.info("started TP rank %d of %d (pid %d)", rank, place.size, proc.pid)
    return proc


def stop_ranks(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait up to `timeout_s` for the ranks to exit, then kill what is left."""
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("TP worker pid %d did not exit in %g s: killed", proc.pid, timeout_s)
            proc.kill()
            proc.wait()
