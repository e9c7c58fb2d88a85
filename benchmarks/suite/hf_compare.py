"""benchmarks/compare_hf.py on the suite's largest checkpoint: mmserve / transformers throughput."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.suite.profile import Profile
from benchmarks.suite.timing import release_memory

from benchmarks import compare_hf


def run_compare_hf(profile: Profile, model_dir: Path, checkpoint: dict) -> dict[str, Any]:
    workload, num_unique = compare_hf.build_workload(profile.compare_requests, seed=0)
    ours = compare_hf.run_mmserve(
        model_dir, workload, profile.compare_output_len, profile.device, profile.dtype
    )
    release_memory(profile.device)
    theirs = compare_hf.run_transformers(
        model_dir, workload, profile.compare_output_len, 16, profile.device, profile.dtype
    )
    release_memory(profile.device)
    same = sum(a == b for a, b in zip(ours.pop("outputs"), theirs.pop("outputs"), strict=True))
    return {
        "checkpoint": {k: checkpoint[k] for k in ("layers", "hidden_size", "vocab_size")},
        "workload": {
            "requests": profile.compare_requests,
            "unique_images": num_unique,
            "output_len": profile.compare_output_len,
            "hf_batch_size": 16,
        },
        "mmserve": ours,
        "transformers": theirs,
        "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "identical_outputs": same,
    }
