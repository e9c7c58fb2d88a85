"""Qwen3-VL fixtures: one tiny checkpoint (odd shapes: tests/support/factory.py) whose answers
depend on the pictures, and transformers loaded on it as the oracle, once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.factory import write_tiny_checkpoint
from tests.support.oracle import HFOracle
from tests.support.parity_cases import DIVERSE


@pytest.fixture(scope="session")
def qwen3_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_vl"), "qwen3_vl", seed=3, **DIVERSE)


@pytest.fixture(scope="session")
def qwen3_oracle(qwen3_vl_dir: Path) -> HFOracle:
    return HFOracle(qwen3_vl_dir)
