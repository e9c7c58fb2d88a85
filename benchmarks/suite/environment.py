"""What ran: the device, the library versions and the mmserve commit the figures belong to."""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit() -> dict[str, Any]:
    """`git rev-parse HEAD` where the tree is a checkout; else `.whl/COMMIT`, which the README's
    device command writes (the device tool copies the working tree without `.git`)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
        if head.returncode == 0:
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=10,
            )
            return {"commit": head.stdout.strip(), "source": "git", "dirty": bool(dirty.stdout)}
    except (OSError, subprocess.TimeoutExpired):
        pass
    stamp = REPO / ".whl" / "COMMIT"
    if stamp.is_file():
        return {"commit": stamp.read_text().strip(), "source": ".whl/COMMIT"}
    return {"commit": None, "source": "none (no git, no .whl/COMMIT)"}


def _source_digest() -> str:
    """A digest of src/mmserve, so that figures name the code even without a commit."""
    digest = hashlib.sha256()
    for path in sorted((REPO / "src" / "mmserve").rglob("*.py")):
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def describe_environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "cpu_threads": torch.get_num_threads(),
        **_commit(),
        "src_digest": _source_digest(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            gpu_memory_bytes=props.total_memory,
            gpu_capability=f"{props.major}.{props.minor}",
            gpu_count=torch.cuda.device_count(),
            driver_free_bytes=torch.cuda.mem_get_info()[0],
        )
    else:
        env["gpu"] = None
    return env
