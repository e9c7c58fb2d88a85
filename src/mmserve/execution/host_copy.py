"""Host values onto the device without waiting for it: pinned staging, non-blocking copies."""

from __future__ import annotations

from typing import Any

import torch


def to_device(data: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`data` (a list or a numpy array) as a `dtype` tensor on `device`.

    NOTE: a plain `torch.tensor(data, device="cuda")` copies from pageable memory and waits
    for every kernel queued before it; after the forward is queued that is a host sync. From
    pinned memory the copy is queued behind the forward instead (the caching host allocator
    keeps the staging buffer alive until the copy has run).
    """
    host = torch.as_tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def fill_cells_(matrix: torch.Tensor, rows: list[int], cols: list[int], value: float) -> None:
    """`matrix[rows[k], cols[k]] = value` for every k, with no host sync on CUDA.

    NOTE: an advanced-index assignment of a Python float builds the value on the host and
    copies it from pageable memory, which waits for the queued forward (seen on an H200 under
    `torch.cuda.set_sync_debug_mode("error")`). `index_fill_` on the flat view takes the value
    as a kernel argument, and the flat indices travel through pinned memory.
    """
    if not matrix.is_contiguous():  # never on the sampler's path: its logits are fresh
        index = to_device([rows, cols], torch.long, matrix.device)
        matrix[index[0], index[1]] = value
        return
    width = matrix.shape[1]
    flat = [r * width + c for r, c in zip(rows, cols, strict=True)]
    matrix.view(-1).index_fill_(0, to_device(flat, torch.long, matrix.device), value)
