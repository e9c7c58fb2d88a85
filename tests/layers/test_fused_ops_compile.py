"""The fused layer kernels lower to sm_90 cubins on the CPU (what the interpreter cannot check)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_the_fused_kernels_compile_for_sm90(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "TRITON_CACHE_DIR": str(tmp_path),  # a cold cache: really compiled, here
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    }
    out = subprocess.run(
        [sys.executable, "-m", "tests.layers.aot_compile"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("bytes") == 3
