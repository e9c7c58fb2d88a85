"""Run a function on N gloo ranks in spawned processes (tensor-parallel tests on CPU).

`run_ranks(fn, size, *args)` starts `size` processes, joins them into one gloo group over a
file store in a fresh temporary directory, calls `fn(group, *args)` on each with its `TPGroup`,
and returns the ranks' results in rank order. `fn` must be a module-level function (spawn
pickles it by name); its result travels back through `torch.save` in the temporary directory.
A rank that raises fails the call with that rank's traceback; a rank that hangs fails it
after `timeout_s` (generous: the machine may be loaded).
"""

from __future__ import annotations

import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmserve.layers.parallel import TPGroup


def _rank_main(
    rank: int, size: int, tmp: str, fn: Callable[..., Any], args: tuple, timeout_s: float
) -> None:
    torch.set_num_threads(1)
    out = Path(tmp) / f"rank{rank}.pt"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/store",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout_s),
        )
        group = TPGroup(rank=rank, size=size, group=dist.group.WORLD)
        torch.save({"ok": fn(group, *args)}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """`fn(group, *args)` on each of `size` gloo ranks; their results in rank order."""
    with tempfile.TemporaryDirectory(prefix="mmserve-tp-") as tmp:
        ctx = mp.start_processes(
            _rank_main,
            args=(size, tmp, fn, args, timeout_s),
            nprocs=size,
            join=False,
            start_method="spawn",
        )
        try:
            while not ctx.join(timeout=timeout_s):
                pass
        except mp.ProcessRaisedException:
            pass  # the rank's own traceback is in its result file: reported below
        results = []
        for rank in range(size):
            path = Path(tmp) / f"rank{rank}.pt"
            if not path.exists():
                raise RuntimeError(f"TP rank {rank} of {size} ended without a result")
            result = torch.load(path, weights_only=False)
            if "error" in result:
                raise RuntimeError(f"TP rank {rank} of {size} failed:\n{result['error']}")
            results.append(result["ok"])
        return results
