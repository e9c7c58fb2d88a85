"""Every Triton kernel lowers to an sm_90 cubin on the CPU (what the interpreter cannot check):
the fused layer ops and the paged attention and KV store, as the engine launches them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def _compile(tmp_path: Path, *flags: str) -> str:
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "TRITON_CACHE_DIR": str(tmp_path),  # a cold cache: really compiled, here
        "TRITON_DEFAULT_FP_FUSION": "1",  # the default the GPU runs with, without its warning
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    }
    out = subprocess.run(
        [sys.executable, "-m", "tests.layers.aot_compile", *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    return out.stdout


def test_every_kernel_compiles_for_sm90_in_its_distinct_lowerings(tmp_path: Path) -> None:
    stdout = _compile(tmp_path)
    assert stdout.count("bytes in") == 16 and "FAILED" not in stdout
    for kernel in ("_rms_norm_kernel", "_silu_mul_kernel", "_rotary_kernel"):
        assert kernel in stdout
    # the 7B's attention: 28 heads over 4 KV heads (group 7 padded to 8) of 128, 8 warps
    assert "GROUP=7, GROUP_PAD=8, BLOCK_Q=16, BLOCK_SIZE=16, HEAD_DIM=128" in stdout
    assert "DOT_PRECISION=ieee" in stdout and "num_warps=8" in stdout
    # head dims that are not powers of two, padded with a masked tail
    assert "HEAD_DIM=72, HEAD_PAD=128" in stdout and "HEAD_DIM=24, HEAD_PAD=32" in stdout
    assert "HALF=36, HALF_PAD=64" in stdout and "HALF=12, HALF_PAD=16" in stdout
    assert "HEAD_DIM=256, HEAD_PAD=256" in stdout  # MAX_HEAD_DIM lowers within shared memory


@pytest.mark.slow
def test_every_attention_specialisation_compiles_for_sm90(tmp_path: Path) -> None:
    stdout = _compile(tmp_path, "--all")
    # 5 head dims x 2 block sizes x 4 groups x 3 dtypes, a KV store per (head dim, block,
    # dtype), and the 6 fused cases
    assert stdout.count("bytes in") == 120 + 30 + 6 and "FAILED" not in stdout
