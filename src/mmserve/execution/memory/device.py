"""Reading a device's memory: the seam the start-up profile run reads its figures through."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class MemorySnapshot(NamedTuple):
    """The device as a whole and this process's torch allocator, at one moment."""

    free_bytes: int  # free on the device (every process)
    total_bytes: int
    reserved_bytes: int  # held by this process's torch caching allocator

    @property
    def outside_torch_bytes(self) -> int:
        """Device memory in use that torch's allocator does not hold: the CUDA context, cuBLAS
        workspaces, kernels' code, and whatever other processes hold."""
        return self.total_bytes - self.free_bytes - self.reserved_bytes


class DeviceMemory(Protocol):
    """What the profile run asks of a device (`CudaMemory`; tests pass recorded readings)."""

    def snapshot(self) -> MemorySnapshot: ...

    def allocated_bytes(self) -> int:
        """Bytes held by live tensors now."""
        ...

    def reset_peak(self) -> None: ...

    def peak_allocated_bytes(self) -> int:
        """The most `allocated_bytes` reached since `reset_peak`."""
        ...

    def synchronize(self) -> None: ...

    def empty_cache(self) -> None:
        """Hand the allocator's unused cached blocks back to the device."""
        ...


class CudaMemory:
    """`DeviceMemory` of one CUDA device, through torch.cuda."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def snapshot(self) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info(self.device)
        return MemorySnapshot(free, total, torch.cuda.memory_reserved(self.device))

    def allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()
