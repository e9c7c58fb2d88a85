"""The KV sizing's input buffer term equals what the runner's persistent buffers allocate."""

from __future__ import annotations

import pytest
import torch

from mmserve.execution.input_batch import InputBuffers, input_buffer_bytes
from mmserve.layers.attention.buffers import BatchLimits, StagedBuffer


def _staged(obj: object) -> list[StagedBuffer]:
    found = []
    for value in vars(obj).values():
        if isinstance(value, StagedBuffer):
            found.append(value)
        elif hasattr(value, "__dict__") and not isinstance(value, torch.Tensor):
            found.extend(_staged(value))
    return found


@pytest.mark.parametrize(("tokens", "seqs", "blocks"), [(1, 1, 1), (8192, 256, 2048), (40, 7, 3)])
def test_the_term_is_the_bytes_the_buffers_hold(tokens: int, seqs: int, blocks: int) -> None:
    limits = BatchLimits(tokens, seqs, blocks)
    # on the CPU the device twin is the host buffer itself: the same bytes CUDA allocates twice
    buffers = _staged(InputBuffers(limits, torch.device("cpu")))
    assert len(buffers) == 11
    assert input_buffer_bytes(limits) == sum(b.host.nbytes for b in buffers)
