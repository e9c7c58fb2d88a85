"""Session-wide fixtures: tiny checkpoints are built once per test run."""

from __future__ import annotations

import importlib.abc
import os
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest

from tests.support.factory import write_tiny_checkpoint


class _TritonModeChooser(importlib.abc.MetaPathFinder):
    """Sets TRITON_INTERPRET=1 without CUDA just before triton is first imported.

    Triton decides once, when it is first imported, whether its kernels run compiled or in its
    interpreter; without CUDA the Triton attention tests need the interpreter. Deciding needs
    torch (is there a CUDA device?), and importing torch here for every run would make the
    torch-free suites (scheduling, wire, processing) pay for it, so the choice waits for the
    first `import triton`, which comes with torch anyway.
    """

    def find_spec(self, name: str, path: object, target: object = None) -> ModuleSpec | None:
        if name == "triton":
            sys.meta_path.remove(self)
            import torch

            if not torch.cuda.is_available():
                os.environ.setdefault("TRITON_INTERPRET", "1")
        return None  # the ordinary finders import it


def pytest_configure(config: pytest.Config) -> None:
    if "triton" not in sys.modules:
        sys.meta_path.insert(0, _TritonModeChooser())


@pytest.fixture(scope="session")
def qwen2_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=0)


@pytest.fixture(scope="session")
def qwen2_5_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl", seed=1)


@pytest.fixture(scope="session", params=["qwen2_vl", "qwen2_5_vl"])
def tiny_checkpoint(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")
