"""Decode CUDA graphs: captured at start-up for a ladder of batch sizes, replayed padded.

A pure-decode step (one new token per sequence, no image) of n sequences runs the graph of the
smallest captured size >= n; anything else (prefill, chunks, mixed, images, or more than the
largest size) runs eagerly. The graphs read fixed device buffers of the largest size:

    row:          0 ........ n-1 | n ......... size-1
    input id      real tokens    | 0
    slot          real slots     | -1 (the KV store skips it: nothing is written)
    seq_len       real lengths   | 1  (a dummy sequence: one key, the dummy block's slot 0)
    block table   real rows      | [DUMMY_BLOCK, ...]
    tile          one per row (tile i = sequence i, its only token): the grid is `size` tiles

A padding row only reads (one key of the dummy block) and its output rows are dropped; rows
never mix in a decoder (attention, norms and MLPs are per token), so the real rows equal the
eager step's. Only the Triton backend is capturable (the torch backend loops in Python over
host values), so graphs run with it on CUDA only.

Tests on the CPU inject `eager_graph_factory`: "replay" runs the captured callable again, so
the capture, padding and replay code is the same one the GPU runs.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from mmserve.config.device import DeviceConfig
from mmserve.execution.device_memory import CudaMemory
from mmserve.execution.graph_capture import CapturedGraph, GraphFactory, cuda_graph_factory
from mmserve.execution.input_batch import StepBatch
from mmserve.layers.attention import AttentionMetadata
from mmserve.layers.attention.triton_backend import TritonAttentionBackend, TritonPlan

if TYPE_CHECKING:
    from mmserve.execution.model_runner import ModelRunner

logger = logging.getLogger(__name__)

MIB = 1 << 20
# Kept free by the KV sizing for the decode graphs' memory pool (unless --enforce-eager): they
# are captured after the KV cache exists, so no profile can measure them first. A decode step's
# activations at the largest captured batch are tens of MiB; the capture measures what they
# took and warns when it is more (`report_graph_memory`).
CUDA_GRAPH_RESERVE_BYTES = 256 * MIB

# Padding rows read block 0: any block serves, since they store nothing and their rows are
# dropped; reading a real sequence's block changes nothing for that sequence.
DUMMY_BLOCK = 0
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
        backend: TritonAttentionBackend,
        block_size: int,
        device: torch.device,
    ) -> None:
        assert sizes and list(sizes) == sorted(set(sizes)), sizes
        self.sizes = tuple(sizes)
        self.backend = backend
        self.block_size = block_size
        n = self.sizes[-1]
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(3, n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, **i32)
        self.block_tables = torch.full((n, max_blocks_per_seq), DUMMY_BLOCK, **i32)
        # constant for every decode step: sequence i is row i, its one token is token i
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.tile_seq_idx = torch.arange(n, **i32)
        self.tile_q_start = torch.zeros(n, **i32)
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
        """The metadata a graph of `size` rows is captured with: views of the fixed buffers,
        the padded plan (one tile per row, `size` tiles: a grid fixed at capture)."""
        plan = TritonPlan(
            tile_seq_idx=self.tile_seq_idx[:size],
            tile_q_start=self.tile_q_start[:size],
            num_tiles=size,
            tokens_per_tile=self.backend.tokens_per_tile,
        )
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            query_start_loc_cpu=tuple(range(size + 1)),
            seq_lens_cpu=(1,) * size,  # capture time's; the kernels read the device buffer
            block_size=self.block_size,
            backend=self.backend,
            plan=plan,
            has_padding=True,
        )

    def run(self, batch: StepBatch) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a pure-decode batch from its graph; None when no
        captured size holds it (the caller runs it eagerly)."""
        meta = batch.attn_metadata
        n = meta.num_seqs
        size = padded_size(self.sizes, n)
        if size is None or not batch.is_pure_decode or meta.block_size != self.block_size:
            return None
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            return None
        # device-to-device copies from the step's buffers, then the padding rows' values
        self.input_ids[:n].copy_(batch.input_ids)
        self.input_ids[n:size].zero_()
        self.positions[:, :n].copy_(batch.positions)
        self.positions[:, n:size].zero_()
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:size].fill_(1)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[n:size, 0].fill_(DUMMY_BLOCK)
        return self.graphs[size].replay()[:n]


def graph_sizes_for(
    *,
    enforce_eager: bool,
    device: torch.device,
    backend_name: str,
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
    if backend_name != "triton":
        logger.info(
            "decode CUDA graphs: off (the %s attention backend is not capturable; "
            "--attention-backend triton captures them)",
            backend_name,
        )
        return ()
    return capture_sizes(max_num_seqs, requested)


def start_decode_graphs(
    runner: ModelRunner, device_config: DeviceConfig, max_num_seqs: int
) -> tuple[int, ...]:
    """Capture the runner's decode graphs at start-up as the flags say; the sizes captured."""
    sizes = graph_sizes_for(
        enforce_eager=device_config.enforce_eager,
        device=runner.device,
        backend_name=runner.attention_backend.name,
        max_num_seqs=max_num_seqs,
        requested=device_config.cuda_graph_sizes,
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
