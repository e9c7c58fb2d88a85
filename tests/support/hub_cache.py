"""A Hugging Face hub cache laid out around the bundled toy checkpoint: no download."""

from __future__ import annotations

import shutil
from pathlib import Path

from mmserve.config.model import bundled_toy_model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"


OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def make_hub_cache(root: Path, repo_id: str, refs: dict[str, str]) -> Path:
    """`root`/hub as huggingface_hub lays it out, one snapshot per distinct commit in refs."""
    repo = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    for ref, commit in refs.items():
        (repo / "refs" / ref).write_text(commit)
        snapshot = repo / "snapshots" / commit
        if not snapshot.exists():
            shutil.copytree(bundled_toy_model_dir(), snapshot)
    return repo
