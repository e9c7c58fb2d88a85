"""Engine fixtures: tiny checkpoints with larger weights, so answers depend on the picture."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.factory import write_tiny_checkpoint
from tests.support.oracle import HFOracle
from tests.support.parity_cases import DIVERSE


@pytest.fixture(scope="session", params=["qwen2_vl", "qwen2_5_vl"])
def diverse_checkpoint(request: pytest.FixtureRequest, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"diverse_{request.param}")
    return write_tiny_checkpoint(out, request.param, seed=3, **DIVERSE)


@pytest.fixture(scope="session")
def oracle_cache() -> dict[Path, HFOracle]:
    return {}


@pytest.fixture
def oracle(diverse_checkpoint: Path, oracle_cache: dict[Path, HFOracle]) -> HFOracle:
    if diverse_checkpoint not in oracle_cache:
        oracle_cache[diverse_checkpoint] = HFOracle(diverse_checkpoint)
    return oracle_cache[diverse_checkpoint]
