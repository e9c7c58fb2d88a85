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
