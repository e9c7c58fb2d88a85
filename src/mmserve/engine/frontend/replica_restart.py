"""Starting data-parallel replicas: their devices, the start-up log, and restarting a lost one.

Each replica is an engine process (`CoreClient.start`) with the whole model, or with
`--tensor-parallel-size` ranks of its own. On CUDA replica i sees its devices (the i-th visible
GPU, or the i-th group of N) through CUDA_VISIBLE_DEVICES; on the CPU they share the cores
(each engine process, or each rank, takes its share of intra-op threads).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from mmserve.config.engine import EngineConfig
from mmserve.config.resolved import ResolvedConfig
from mmserve.engine.frontend.core_client import CoreClient
from mmserve.metrics import EngineMetrics

logger = logging.getLogger(__name__)

# Seconds before each try to restart a lost replica; the last repeats until one succeeds.
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
RESTART_JOIN_S = 5.0  # how long shutdown waits for a restart in progress


class StartedReplica(NamedTuple):
    index: int
    device: str
    client: CoreClient
    metrics: EngineMetrics
    resolved: ResolvedConfig


def replica_env(config: EngineConfig, index: int) -> dict[str, str]:
    """The environment replica `index`'s engine process gets on top of this one's.

    On a GPU (`--device cuda` or `auto`): CUDA_VISIBLE_DEVICES naming the replica's devices,
    `--tensor-parallel-size` of them (one without it), the index-th group of those this process
    may use. On the CPU with tensor-parallel replicas: OMP_NUM_THREADS sharing the cores left
    to the engines (one stays with the API process) between every rank of every replica.
    """
    tp = config.parallel.tensor_parallel_size
    if config.device.device == "cpu":
        if tp == 1 or "OMP_NUM_THREADS" in os.environ:
            return {}  # the engine process splits the cores itself (engine.core.process)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        ranks = config.parallel.data_parallel_size * tp
        return {"OMP_NUM_THREADS": str(max(1, ((cpus or 1) - 1) // ranks))}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(index * tp + r) for r in range(tp))}
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    needed = config.parallel.data_parallel_size * tp
    if len(ids) < needed:
        raise ValueError(
            f"--data-parallel-size {config.parallel.data_parallel_size} needs {tp} GPU(s) per "
            f"replica ({needed} in all), but CUDA_VISIBLE_DEVICES={visible!r} names {len(ids)}"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[index * tp : (index + 1) * tp])}


def start_replica(config: EngineConfig, index: int, metrics: EngineMetrics) -> StartedReplica:
    """Start replica `index`, its stats recorded in `metrics`, and wait until its model is
    loaded."""
    env = replica_env(config, index)
    client, resolved = CoreClient.start(config, metrics, env=env)
    device = resolved.device
    if "CUDA_VISIBLE_DEVICES" in env and device.startswith("cuda"):  # its GPUs from cuda:0
        device = f"cuda:{env['CUDA_VISIBLE_DEVICES']} ({device} in its process)"
    return StartedReplica(index, device, client, metrics, resolved)


def start_replicas(config: EngineConfig, max_model_len: int) -> list[StartedReplica]:
    """Start every replica at once and wait for all; if one fails, stop the others and raise.
    Logs one line naming the replicas and their devices."""
    num = config.parallel.data_parallel_size
    with ThreadPoolExecutor(num, thread_name_prefix="mmserve-replica-start") as pool:
        futures = [
            pool.submit(start_replica, config, i, EngineMetrics(max_model_len=max_model_len))
            for i in range(num)
        ]
        outcomes: list[StartedReplica | BaseException] = []
        for future in futures:
            try:
                outcomes.append(future.result())
            except Exception as exc:  # noqa: BLE001 - reported below, after stopping the rest
                outcomes.append(exc)
    started = [o for o in outcomes if isinstance(o, StartedReplica)]
    failed = [(i, o) for i, o in enumerate(outcomes) if not isinstance(o, StartedReplica)]
    kinds = {s.resolved.device.split(":")[0] for s in started}
    if failed or len(kinds) > 1:
        for s in started:
            s.client.shutdown()
        if failed:
            index, exc = failed[0]
            raise RuntimeError(f"data-parallel replica {index} failed to start: {exc}") from exc
        raise ValueError(
            f"--data-parallel-size {num}: the replicas found different devices "
            f"({', '.join(s.device for s in started)}); each needs a GPU of its own, or "
            "run all on the CPU with --device cpu"
        )
    logger.info(
        "data parallel: %d engine replicas behind this server: %s",
        num,
        "; ".join(f"replica {s.index} on {s.device} (pid {s.client.proc.pid})" for s in started),
    )
    return started


class Restarts:
    """Restarts lost replicas in background threads, each with a bounded backoff; the engine
    thread takes the ones that are ready (`ready`) and routes to them again."""

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._ready: queue.SimpleQueue[StartedReplica] = queue.SimpleQueue()
        self._threads: dict[int, threading.Thread] = {}
        self._stopping = threading.Event()

    def begin(self, index: int, metrics: EngineMetrics) -> None:
        """Restart replica `index` (its stats go on in `metrics`) unless a restart of it is
        already under way."""
        thread = self._threads.get(index)
        if self._stopping.is_set() or (thread is not None and thread.is_alive()):
            return
        thread = threading.Thread(
            target=self._restart,
            args=(index, metrics),
            name=f"mmserve-replica-{index}",
            daemon=True,
        )
        self._threads[index] = thread
        thread.start()

    def ready(self) -> list[StartedReplica]:
        out = []
        while True:
            try:
                out.append(self._ready.get_nowait())
            except queue.Empty:
                return out

    def stop(self) -> None:
        """No more restarts; a replica that finishes starting now is stopped again."""
        self._stopping.set()
        for thread in self._threads.values():
            thread.join(RESTART_JOIN_S)
        for started in self.ready():
            started.client.shutdown()

    def _restart(self, index: int, metrics: EngineMetrics) -> None:
        attempt = 0
        while not self._stopping.wait(RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]):
            attempt += 1
            try:
                started = start_replica(self._config, index, metrics)
            except Exception:  # noqa: BLE001 - tried again after the next backoff
                logger.exception("replica %d failed to restart (try %d)", index, attempt)
                continue
            if self._stopping.is_set():
                started.client.shutdown()
                return
            logger.info("replica %d restarted on %s; it rejoins", index, started.device)
            self._ready.put(started)
            return
