"""Persistent staging for per-step attention metadata: host buffers (pinned on CUDA) and their
device twins, allocated once at start-up; each step fills a prefix on the host and sends it
with one non-blocking copy per buffer, so no step allocates a tensor for its metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


class StagedBuffer:
    """A flat host buffer and its device twin (the same tensor on a CPU device)."""

    def __init__(self, num_elements: int, dtype: torch.dtype, device: torch.device) -> None:
        is_cuda = device.type == "cuda"
        self.host = torch.zeros(num_elements, dtype=dtype, pin_memory=is_cuda)
        self.device = torch.zeros(num_elements, dtype=dtype, device=device) if is_cuda else None
        self._host_np = self.host.numpy()

    @property
    def num_elements(self) -> int:
        return self.host.numel()

    def host_view(self, *shape: int) -> np.ndarray:
        """The first prod(shape) host elements as a writable numpy array of `shape`."""
        n = math.prod(shape)
        assert n <= self.num_elements, f"{n} elements exceed the buffer's {self.num_elements}"
        return self._host_np[:n].reshape(shape)

    def push(self, *shape: int) -> torch.Tensor:
        """Send the first prod(shape) host elements; their device view of `shape`."""
        n = math.prod(shape)
        if self.device is None:
            return self.host[:n].view(shape)
        self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n].view(shape)

    def device_view(self, *shape: int) -> torch.Tensor:
        n = math.prod(shape)
        return (self.host if self.device is None else self.device)[:n].view(shape)


@dataclass(frozen=True)
class BatchLimits:
    """The largest step the buffers hold: the scheduler's budgets."""

    max_num_tokens: int  # --max-num-batched-tokens
    max_num_seqs: int  # --max-num-seqs
    max_blocks_per_seq: int  # ceil(max_model_len / block_size)

    def __post_init__(self) -> None:
        for name in ("max_num_tokens", "max_num_seqs", "max_blocks_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"BatchLimits.{name} must be >= 1, got {getattr(self, name)}")


class AttentionBuffers:
    """Where `build_metadata` writes one step's layout and plan (see `metadata.py`)."""

    def __init__(self, limits: BatchLimits, device: torch.device | str) -> None:
        device = torch.device(device)
        n, s = limits.max_num_tokens, limits.max_num_seqs
        self.limits = limits
        self.slot_mapping = StagedBuffer(n, torch.int64, device)  # [num_tokens]
        self.block_tables = StagedBuffer(s * limits.max_blocks_per_seq, torch.int32, device)
        self.seq_lens = StagedBuffer(s, torch.int32, device)  # [num_seqs]
        self.query_start_loc = StagedBuffer(s + 1, torch.int32, device)  # [num_seqs + 1]
        # backend plans: Triton's query tiles (at most one per token), torch's decode groups
        self.tile_seq_idx = StagedBuffer(n, torch.int32, device)
        self.tile_q_start = StagedBuffer(n, torch.int32, device)
        self.decode_seq_idx = StagedBuffer(s, torch.int64, device)
        self.decode_token_idx = StagedBuffer(s, torch.int64, device)
