"""Random checkpoints shaped like Qwen2-VL-2B and -7B (tests/support/factory.py) and their bytes."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

from benchmarks.suite.profile import CheckpointSpec, Profile
from benchmarks.suite.timing import release_memory
from tests.support.factory import write_tiny_checkpoint

from mmserve.config.model import bundled_toy_model_dir

DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4}


def write_checkpoints(profile: Profile, root: Path) -> dict[str, Any]:
    """One directory per spec; the toy model is the bundled one. Weights are initialised on the
    profile's device and saved in its dtype (a float32 7B on a CPU would take minutes)."""
    out: dict[str, Any] = {}
    for i, spec in enumerate(profile.checkpoints):
        start = time.perf_counter()
        path = checkpoint_dir(spec, root)
        if spec.overrides is not None and not (path / "config.json").is_file():
            write_tiny_checkpoint(
                path, "qwen2_vl", seed=i, dtype=profile.dtype, device=profile.device,
                **spec.overrides,
            )  # fmt: skip
            release_memory(profile.device)
        out[spec.name] = {
            "dir": str(path),
            "write_s": time.perf_counter() - start,
            **describe_checkpoint(path),
        }
    return out


def checkpoint_dir(spec: CheckpointSpec, root: Path) -> Path:
    return Path(bundled_toy_model_dir()) if spec.overrides is None else root / spec.name


def _safetensors_entries(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return header


def describe_checkpoint(path: Path) -> dict[str, Any]:
    """Parameter bytes by part, from the safetensors headers (no weight is read).

    `lm_bytes_per_decode_step` is what one decode step must read at least: every language-model
    weight except the embedding table (one row per token is gathered), plus the LM head; with
    tied embeddings the table is the head and is read whole. `lm_bytes` is the whole language
    model, the convention of issue #15's 15.2 GB limit for the 7B shape.
    """
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    parts = {"vision": 0, "embedding": 0, "lm_head": 0, "decoder": 0}
    for file in sorted(path.glob("*.safetensors")):
        for name, entry in _safetensors_entries(file).items():
            size = DTYPE_BYTES[entry["dtype"]]
            for dim in entry["shape"]:
                size *= dim
            if "visual" in name:
                parts["vision"] += size
            elif "embed_tokens" in name:
                parts["embedding"] += size
            elif name.startswith("lm_head"):
                parts["lm_head"] += size
            else:
                parts["decoder"] += size
    tied = parts["lm_head"] == 0
    head = parts["embedding"] if tied else parts["lm_head"]
    return {
        "layers": text["num_hidden_layers"],
        "hidden_size": text["hidden_size"],
        "vocab_size": text["vocab_size"],
        "weight_bytes": parts,
        "lm_bytes": parts["embedding"] + parts["lm_head"] + parts["decoder"],
        "lm_bytes_per_decode_step": parts["decoder"] + head,
    }
