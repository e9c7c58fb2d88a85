"""What the decode and the encoder CUDA graphs share: capture into one memory pool, replay
into a static output, and the eager stand-in the CPU tests inject in place of a graph.

Both callers capture a callable that reads and writes only tensors that outlive the graph
(their fixed input buffers); `replay()` reruns the captured work on whatever those buffers
hold now and returns the same output tensor every time, so a caller must take (slice, clone
or consume) what it needs before the next replay of any graph in the pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

# Launches before capture: Triton compiles a kernel on its first launch and cuBLAS creates
# its handles lazily; neither may happen inside a capture.
WARMUP_RUNS = 2


class CapturedGraph(Protocol):
    output: torch.Tensor

    def replay(self) -> torch.Tensor:
        """Run the captured work again on the current buffer contents; returns `output`."""
        ...


GraphFactory = Callable[[Callable[[], torch.Tensor]], CapturedGraph]


class CudaGraph:
    """`fn` captured once, after warm-up runs on a side stream, replayed as one launch."""

    def __init__(
        self, fn: Callable[[], torch.Tensor], pool: object, device: torch.device | None
    ) -> None:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


def cuda_graph_factory(device: torch.device | None = None) -> GraphFactory:
    """A factory whose graphs share one memory pool: replays are serial and each output is
    consumed before the next replay, so the pool holds the largest graph's activations, not
    the sum of all of them."""
    pool = torch.cuda.graph_pool_handle()
    return lambda fn: CudaGraph(fn, pool, device)


class EagerGraph:
    """A graph's contract without CUDA (CPU tests): replay reruns `fn` and copies its result
    into the same static output, so a caller that keeps a view across replays sees it change,
    as it would with a real graph."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn
        self.output = fn()

    def replay(self) -> torch.Tensor:
        self.output.copy_(self.fn())
        return self.output


def eager_graph_factory(fn: Callable[[], torch.Tensor]) -> CapturedGraph:
    return EagerGraph(fn)
