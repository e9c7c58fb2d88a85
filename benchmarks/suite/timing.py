"""Wall time of device work: synchronise before reading the clock, keep the best of N."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_seconds(fn: Callable[[], object], repeats: int, device: str, warmup: int = 1) -> float:
    """The fastest of `repeats` timed calls after `warmup` untimed ones (the best, not the mean:
    the figure is a peak, and the slower calls measure interference, not the device)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def release_memory(device: str) -> None:
    """Give freed tensors back before the next section loads a model of several GB."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
