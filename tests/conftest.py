"""Session-wide fixtures: tiny checkpoints are built once per test run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.factory import write_tiny_checkpoint

# Triton decides once, when it is first imported, whether its kernels run compiled or in its
# interpreter; without CUDA the Triton attention tests need the interpreter, so it is chosen
# here, before any test imports triton (tests/layers/test_triton_attention.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def qwen2_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=0)


@pytest.fixture(scope="session")
def qwen2_5_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl", seed=1)


@pytest.fixture(scope="session", params=["qwen2_vl", "qwen2_5_vl"])
def tiny_checkpoint(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")
