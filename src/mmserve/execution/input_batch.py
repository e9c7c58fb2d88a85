"""One step's flat token batch, written into persistent input buffers.

The buffers are allocated once at start-up for the scheduler's budgets (`BatchLimits`): host
tensors (pinned when the device is CUDA) filled with numpy each step, and device twins that
receive them by non-blocking copies. A step therefore allocates no input tensor, and the
device buffers keep their addresses, which is what a CUDA graph replays from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.errors import FailureKind, RequestFailure
from mmserve.execution.host_copy import to_device
from mmserve.execution.request_state import RequestState
from mmserve.layers.attention import AttentionBackend, AttentionMetadata
from mmserve.layers.attention.buffers import AttentionBuffers, BatchLimits, StagedBuffer
from mmserve.scheduling.outputs import SchedulerOutput

logger = logging.getLogger(__name__)

# (state, start, end, window token ids) -> (placeholder indices in the window, embedding slices)
GatherEmbeddings = Callable[
    [RequestState, int, int, list[int]], tuple[list[int], list[torch.Tensor]]
]


class SpliceError(Exception):
    """The embeddings of a request do not match its placeholders; fails that request only.

    REQUEST when the prompt's own placeholders disagree with its items, INTERNAL when the
    runner lost what the scheduler said it holds.
    """

    def __init__(self, message: str, kind: FailureKind = FailureKind.REQUEST) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class StepBatch:
    """The flat token batch of one step (requests in scheduling order) and its metadata."""

    request_ids: list[str]
    input_ids: torch.Tensor  # [num_tokens] int64 (device)
    positions: torch.Tensor  # [3, num_tokens] int64 (device)
    mm_index: torch.Tensor | None  # [num_mm_tokens] flat indices of placeholder tokens
    mm_embeds: torch.Tensor | None  # [num_mm_tokens, mm_embedding_width]: the model splits it
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [num_samples] int64: last token of each request that samples
    sample_request_ids: list[str]

    @property
    def num_tokens(self) -> int:
        return self.attn_metadata.num_tokens

    @property
    def is_pure_decode(self) -> bool:
        """One new token per sequence and no image in it: the step a decode graph replays."""
        return self.mm_embeds is None and self.num_tokens == self.attn_metadata.num_seqs


class InputBuffers:
    """Token ids, M-RoPE positions, sample rows and the attention metadata's buffers."""

    def __init__(self, limits: BatchLimits, device: torch.device) -> None:
        self.limits = limits
        self.device = device
        self.input_ids = StagedBuffer(limits.max_num_tokens, torch.int64, device)
        self.positions = StagedBuffer(3 * limits.max_num_tokens, torch.int64, device)
        self.sample_rows = StagedBuffer(limits.max_num_seqs, torch.int64, device)
        self.attention = AttentionBuffers(limits, device)
        self._sent: torch.cuda.Event | None = None

    def fits(self, num_tokens: int, num_seqs: int, max_blocks: int) -> bool:
        lim = self.limits
        return (
            num_tokens <= lim.max_num_tokens
            and num_seqs <= lim.max_num_seqs
            and max_blocks <= lim.max_blocks_per_seq
        )

    def wait_until_sent(self) -> None:
        """Before the host buffers are written again: the previous step's copies have left.

        NOTE: a step that samples reads the device back, so its copies are long done; a step
        that only prefills does not, and its copies may still be queued behind earlier work.
        """
        if self._sent is not None:
            self._sent.synchronize()
            self._sent = None

    def mark_sent(self) -> None:
        if self.device.type == "cuda":
            self._sent = torch.cuda.Event()
            self._sent.record()


def input_buffer_bytes(limits: BatchLimits) -> int:
    """The device bytes `InputBuffers(limits, cuda)` allocates (and as much pinned host memory):
    what the KV sizing leaves for them, since the runner builds them after it."""
    n, s, b = limits.max_num_tokens, limits.max_num_seqs, limits.max_blocks_per_seq
    int64_elements = n + 3 * n + s  # input ids, positions [3, n], sample rows
    int64_elements += n + 2 * s  # slot mapping; torch's decode groups (sequence, token)
    int32_elements = s * b + s + (s + 1)  # block tables, seq lens, query start locations
    int32_elements += 2 * n  # Triton's query tiles: sequence and first token of each
    return 8 * int64_elements + 4 * int32_elements


def prepare_batch(
    so: SchedulerOutput,
    states: Mapping[str, RequestState],
    errors: dict[str, RequestFailure],
    gather: GatherEmbeddings,
    buffers: InputBuffers,
    backend: AttentionBackend,
    block_size: int,
) -> StepBatch | None:
    """The step's batch, every request that fails its splice left out (and put in `errors`);
    None when no request is left."""
    ids: list[int] = []
    positions: list[np.ndarray] = []
    mm_index: list[int] = []
    mm_parts: list[torch.Tensor] = []
    request_ids, query_lens, seq_lens, block_tables = [], [], [], []
    sample_rows, sample_request_ids = [], []
    for request_id, num_tokens in so.num_scheduled_tokens.items():
        if request_id in errors:
            continue
        state = states[request_id]
        start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
        window_ids = state.token_ids[start:end]
        try:
            local_index, parts = gather(state, start, end, window_ids)
        except SpliceError as exc:
            if exc.kind is FailureKind.INTERNAL:
                logger.error("request %s: %s", request_id, exc, exc_info=exc.__cause__)
            errors[request_id] = RequestFailure(str(exc), exc.kind)
            continue
        offset = len(ids)
        ids.extend(window_ids)
        positions.append(state.positions(start, end))
        mm_index.extend(offset + i for i in local_index)
        mm_parts.extend(parts)
        request_ids.append(request_id)
        query_lens.append(num_tokens)
        seq_lens.append(end)
        block_tables.append(state.block_ids)
        if end >= len(state.token_ids):
            sample_rows.append(len(ids) - 1)
            sample_request_ids.append(request_id)
    if not request_ids:
        return None
    max_blocks = max(len(t) for t in block_tables)
    staged = buffers if buffers.fits(len(ids), len(request_ids), max_blocks) else None
    if staged is None:
        staged = InputBuffers(BatchLimits(len(ids), len(request_ids), max_blocks), buffers.device)
    staged.input_ids.host_view(len(ids))[:] = ids
    np.concatenate(positions, axis=1, out=staged.positions.host_view(3, len(ids)))
    staged.sample_rows.host_view(len(sample_rows))[:] = sample_rows
    # Once per step, before the forward: every layer reads this one metadata.
    attn_metadata = backend.build_metadata(
        query_lens, seq_lens, block_tables, block_size, buffers.device, buffers=staged.attention
    )
    device = buffers.device
    return StepBatch(
        request_ids,
        staged.input_ids.push(len(ids)),
        staged.positions.push(3, len(ids)),
        to_device(mm_index, torch.long, device) if mm_parts else None,
        torch.cat(mm_parts) if mm_parts else None,
        attn_metadata,
        staged.sample_rows.push(len(sample_rows)),
        sample_request_ids,
    )
