"""The ranks' rendezvous: a TCPStore on rank 0, every rank checks in, then torch.distributed.

A rank that never comes is named: each rank writes `joined/<rank>` to the store, and the
ranks wait for all of them until `timeout_s`, then fail with the ranks still missing (rather
than the generic timeout of `init_process_group`).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from mmserve.layers.parallel import TPGroup

logger = logging.getLogger(__name__)

# How often a waiting rank looks whether the others have checked in.
POLL_S = 0.2


class RendezvousError(RuntimeError):
    """The ranks could not all meet: the message names the missing ones."""


def join_group(
    rank: int,
    size: int,
    *,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    device: torch.device,
) -> TPGroup:
    """This process as `rank` of `size`: NCCL on CUDA, gloo on the CPU."""
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(
            master_addr,
            master_port,
            size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as exc:
        where = f"{master_addr}:{master_port}"
        if rank == 0:
            raise RendezvousError(
                f"rank 0 cannot listen for the rendezvous at {where}: {exc}"
            ) from exc
        raise RendezvousError(
            f"rank {rank} of {size} could not reach the rendezvous at {where} (rank 0, node 0) "
            f"within {timeout_s:g} s: is node 0 started with the same --master-addr and "
            "--master-port?"
        ) from exc
    store.set(f"joined/{rank}", "1")
    _wait_for_ranks(store, size, timeout_s, rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    logger.info("rank %d of %d joined (%s, %s)", rank, size, backend, device)
    return TPGroup(rank=rank, size=size, group=dist.group.WORLD)


def _wait_for_ranks(store: dist.TCPStore, size: int, timeout_s: float, rank: int) -> None:
    deadline = time.monotonic() + timeout_s
    missing = list(range(size))
    while True:
        missing = [r for r in missing if not store.check([f"joined/{r}"])]
        if not missing:
            return
        if time.monotonic() >= deadline:
            names = ", ".join(str(r) for r in missing)
            raise RendezvousError(
                f"rank {rank}: the rendezvous timed out after {timeout_s:g} s (--distributed-"
                f"timeout-seconds) waiting for rank(s) {names} of {size}: start the nodes that "
                "run them (`mmserve serve --headless --node-rank ...`) or check their logs"
            )
        time.sleep(POLL_S)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
