"""Decode CUDA graphs: captured at start-up for a ladder of batch sizes, replayed padded.

A pure-decode step (one new token per sequence, no image) of n sequences runs the graph of the
smallest captured size >= n; anything else (prefill, chunks, mixed, images, or more than the
largest size) runs eagerly. The graphs read fixed device buffers of the largest size:

    row:          0 ........ n-1 | n ......... size-1
    input id      real tokens    | 0
    position      real positions | 0
    attention     the backend's capture buffers (`AttentionBackend.prepare_for_replay`): a
                  padding row stores nothing and reads one key of a dummy block

A padding row's output rows are dropped; rows never mix in a decoder (attention, norms and
MLPs are per token), so the real rows equal the eager step's. The backend says whether it can
be captured (`supports_capture`: the Triton backend; the torch backend loops in Python over
host values), and graphs run on CUDA only.

Tests on the CPU inject `eager_graph_factory`: "replay" runs the captured callable again, so
the capture, padding and replay code is the same one the GPU runs.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from mmserve.execution.graphs.capture import CapturedGraph, GraphFactory
from mmserve.execution.input_batch import StepBatch
from mmserve.layers.attention import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

MIB = 1 << 20
# Kept free by the KV sizing for the decode graphs' memory pool (unless --enforce-eager): they
# are captured after the KV cache exists, so no profile can measure them first. A decode step's
# activations at the largest captured batch are tens of MiB; the capture measures what they
# took and warns when it is more (`report_graph_memory`).
CUDA_GRAPH_RESERVE_BYTES = 256 * MIB

# The ladder: every size up to 8 that a small batch hits, then steps of 8 to 64, then 16.
_LADDER_HEAD = (1, 2, 4, 8)
_STEP_TO_64, _STEP_AFTER_64 = 8, 16

# (input_ids [n], positions [3, n], metadata) -> hidden states [n, hidden]
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int, requested: Sequence[int] | None = None) -> tuple[int, ...]:
    """The batch sizes to capture. vLLM's `--cuda-graph-sizes` rule: no value, the ladder up
    to `max_num_seqs`; one value, the ladder up to it; several, exactly those. Never above
    `max_num_seqs` (no decode step is larger)."""
    if requested and len(requested) > 1:
        return tuple(sorted({s for s in requested if s <= max_num_seqs}))
    top = min(requested[0], max_num_seqs) if requested else max_num_seqs
    ladder = set(_LADDER_HEAD)
    ladder.update(range(16, 65, _STEP_TO_64))
    ladder.update(range(64 + _STEP_AFTER_64, top + 1, _STEP_AFTER_64))
    ladder.add(top)
    return tuple(sorted(s for s in ladder if s <= top))


def padded_size(sizes: Sequence[int], num_seqs: int) -> int | None:
    """The smallest captured size that holds `num_seqs` (sizes sorted), or None."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """The captured decode graphs of one model runner and the fixed buffers they read."""

    def __init__(
        self,
        sizes: Sequence[int],
        max_blocks_per_seq: int,
        backend: AttentionBackend,
        block_size: int,
        device: torch.device,
    ) -> None:
        assert sizes and list(sizes) == sorted(set(sizes)), sizes
        self.sizes = tuple(sizes)
        self.backend = backend
        n = self.sizes[-1]
        backend.init_capture(n, max_blocks_per_seq, block_size, device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(3, n, dtype=torch.int64, device=device)
        self.graphs: dict[int, CapturedGraph] = {}

    def capture(self, forward: DecodeForward, factory: GraphFactory) -> float:
        """Capture every size, largest first; the seconds it took."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            metadata = self.padded_metadata(size)
            ids, positions = self.input_ids[:size], self.positions[:, :size]
            self.graphs[size] = factory(lambda i=ids, p=positions, m=metadata: forward(i, p, m))
        return time.perf_counter() - start

    def padded_metadata(self, size: int) -> AttentionMetadata:
        """The metadata a graph of `size` rows is captured with (the backend's views of its
        capture buffers: what every replay of that graph reads)."""
        return self.backend.prepare_for_capture(size)

    def run(self, batch: StepBatch) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a pure-decode batch from its graph; None when no
        captured size holds it (the caller runs it eagerly)."""
        n = batch.attn_metadata.num_seqs
        size = padded_size(self.sizes, n)
        if size is None or not batch.is_pure_decode:
            return None
        if not self.backend.prepare_for_replay(batch.attn_metadata, size):
            return None
        # device-to-device copies from the step's buffers, then the padding rows' values
        self.input_ids[:n].copy_(batch.input_ids)
        self.input_ids[n:size].zero_()
        self.positions[:, :n].copy_(batch.positions)
        self.positions[:, n:size].zero_()
        return self.graphs[size].replay()[:n]


def graph_sizes_for(
    *,
    enforce_eager: bool,
    device: torch.device,
    backend: AttentionBackend,
    max_num_seqs: int,
    requested: Sequence[int] | None,
) -> tuple[int, ...]:
    """The sizes to capture at start-up, or () with the reason logged once."""
    if enforce_eager:
        logger.info(
            "--enforce-eager: decode CUDA graphs and encoder CUDA graphs off; every step runs "
            "eagerly and the KV sizing keeps no CUDA graph reserve"
        )
        return ()
    if device.type != "cuda":
        logger.info("decode CUDA graphs: off (device %s; they need a CUDA device)", device)
        return ()
    if not backend.supports_capture:
        logger.info(
            "decode CUDA graphs: off (the %s attention backend is not capturable; "
            "--attention-backend triton captures them)",
            backend.name,
        )
        return ()
    return capture_sizes(max_num_seqs, requested)


class GraphMemory(NamedTuple):
    """What capturing the decode graphs took, in bytes."""

    pool_bytes: int  # torch's allocator grew by this: the graphs' pool and their fixed buffers
    device_bytes: int  # the device's free memory shrank by this: the pool and the graphs

    @property
    def used_bytes(self) -> int:
        return max(self.pool_bytes, self.device_bytes)


def report_graph_memory(taken: GraphMemory, reserve_bytes: int) -> bool:
    """Log what the capture took beside the reserve the KV sizing kept; a warning naming the
    flags to lower when it took more. True when it fit."""
    fits = taken.used_bytes <= reserve_bytes
    text = (
        f"decode CUDA graphs took {taken.used_bytes / MIB:.1f} MiB (pool "
        f"{taken.pool_bytes / MIB:.1f} MiB, device {taken.device_bytes / MIB:.1f} MiB) of the "
        f"{reserve_bytes // MIB} MiB CUDA graph reserve"
    )
    if fits:
        logger.info("%s", text)
    else:
        logger.warning(
            "%s: the KV cache left too little for them, and a later allocation may run out of "
            "memory. Lower --cuda-graph-sizes (the largest captured batch), --max-num-seqs or "
            "--gpu-memory-utilization, or pass --enforce-eager (no CUDA graphs)",
            text,
        )
    return fits
