"""The worker's start-up: decode graphs captured once the KV cache exists."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from mmserve.execution.device_memory import CudaMemory
from mmserve.execution.graphs.capture import cuda_graph_factory
from mmserve.execution.graphs.decode import (
    CUDA_GRAPH_RESERVE_BYTES,
    GraphMemory,
    graph_sizes_for,
    report_graph_memory,
)
from mmserve.execution.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def start_decode_graphs(
    runner: ModelRunner,
    *,
    enforce_eager: bool,
    max_num_seqs: int,
    requested: Sequence[int] | None,
) -> tuple[int, ...]:
    """Capture the runner's decode graphs at start-up as the flags say; the sizes captured."""
    sizes = graph_sizes_for(
        enforce_eager=enforce_eager,
        device=runner.device,
        backend=runner.attention_backend,
        max_num_seqs=max_num_seqs,
        requested=requested,
    )
    if not sizes:
        return ()
    memory = CudaMemory(runner.device)
    memory.synchronize()
    before = memory.snapshot()
    seconds = runner.capture_decode_graphs(sizes, cuda_graph_factory())
    memory.synchronize()
    after = memory.snapshot()
    logger.info(
        "decode CUDA graphs: captured %d batch sizes %s in %.2f s (--enforce-eager turns "
        "them off, --cuda-graph-sizes picks the sizes)",
        len(sizes),
        list(sizes),
        seconds,
    )
    report_graph_memory(
        GraphMemory(
            pool_bytes=after.reserved_bytes - before.reserved_bytes,
            device_bytes=before.free_bytes - after.free_bytes,
        ),
        CUDA_GRAPH_RESERVE_BYTES,
    )
    return sizes
