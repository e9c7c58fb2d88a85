"""Measured peaks: dense GEMM throughput and memory bandwidth, the yardsticks of every ratio."""

from __future__ import annotations

from typing import Any

import torch
from benchmarks.suite.profile import Profile
from benchmarks.suite.timing import best_seconds


def measure_peaks(profile: Profile) -> dict[str, Any]:
    dtype = torch.bfloat16 if profile.device == "cuda" else torch.float32
    n = profile.gemm_size
    a = torch.randn(n, n, device=profile.device, dtype=dtype)
    b = torch.randn(n, n, device=profile.device, dtype=dtype)
    out = torch.empty(n, n, device=profile.device, dtype=dtype)

    def gemm() -> None:
        # Several matmuls per timed call so that launch latency is not part of the figure.
        for _ in range(8):
            torch.mm(a, b, out=out)

    gemm_s = best_seconds(gemm, profile.gemm_repeats, profile.device) / 8
    gemm_flops = 2 * n**3  # one multiply and one add per (i, j, k)

    num_elements = profile.copy_bytes // 4
    src = torch.empty(num_elements, device=profile.device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = best_seconds(lambda: dst.copy_(src), profile.copy_repeats, profile.device)
    moved_bytes = 2 * profile.copy_bytes  # every byte is read once and written once
    return {
        "gemm": {
            "m_n_k": n,
            "dtype": str(dtype).removeprefix("torch."),
            "ms": gemm_s * 1e3,
            "tflops": gemm_flops / gemm_s / 1e12,
        },
        "bandwidth": {
            "buffer_bytes": profile.copy_bytes,
            "method": "device-to-device copy (read + write counted)",
            "ms": copy_s * 1e3,
            "gb_per_s": moved_bytes / copy_s / 1e9,
        },
    }
