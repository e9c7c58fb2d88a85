"""Tensor-parallel fixtures: one diverse tiny checkpoint per architecture, and its oracle."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.factory import write_tiny_checkpoint
from tests.support.oracle import HFOracle
from tests.support.parity_cases import DIVERSE

ARCHITECTURES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# A small KV cache per rank: zeroing the CPU default (2 GiB) would cost each rank seconds.
SMALL_KV = {"kv_cache_memory_bytes": 16 << 20}


@pytest.fixture(scope="session")
def tp_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: write_tiny_checkpoint(tmp_path_factory.mktemp(f"tp_{arch}"), arch, seed=3, **DIVERSE)
        for arch in ARCHITECTURES
    }


@pytest.fixture(scope="session")
def tp_oracles(tp_checkpoints: dict[str, Path]) -> dict[str, HFOracle]:
    return {arch: HFOracle(path) for arch, path in tp_checkpoints.items()}
