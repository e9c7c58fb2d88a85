"""CUDA graphs against eager: decode steps, the vision tower (1024x1024 and a thumbnail batch)
and the engine on images, each with and without graphs, for the options that are built."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.suite.decode import measure_decode
from benchmarks.suite.llm_session import ENGINE_FIELDS, open_llm
from benchmarks.suite.parity import PROMPTS, _requests
from benchmarks.suite.profile import Profile
from benchmarks.suite.vit_graphs import compare_vit_graphs

from mmserve import SamplingParams

# Options that exist only once graphs are captured. `enforce_eager` alone proves nothing: it is
# accepted for copied vLLM command lines whether or not any graph is built.
GRAPH_FIELDS = (
    "enable_encoder_cuda_graph",
    "cuda_graph_sizes",
    "cudagraph_capture_sizes",
    "max_cudagraph_capture_size",
    "compilation_config",
)


def graph_fields() -> list[str]:
    return [name for name in GRAPH_FIELDS if name in ENGINE_FIELDS]


def _image_run(profile: Profile, model_dir: Path, **extra: Any) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=profile.parity_tokens, ignore_eos=True)
    requests = [
        {"prompt": p, "multi_modal_data": {"image": imgs[0]}} for p, imgs in _requests() if imgs
    ] * 4
    with open_llm(profile, model_dir, profile.dtype, **extra) as llm:
        llm.generate(requests[:1], params, use_tqdm=False)  # warm-up (and capture)
        start = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def compare_graphs(
    profile: Profile,
    model_dir: Path,
    limit_ms: float | None,
    *,
    decode_with_graphs: dict[str, Any] | None = None,
    image_model_dir: Path | None = None,
) -> dict[str, Any]:
    """`decode_with_graphs`: the decode section's Triton figures, when its engine captured
    graphs (the default off --enforce-eager): reused, so that only the eager run is measured
    here. `image_model_dir`: the checkpoint of the engine runs on images (default
    `model_dir`)."""
    found = graph_fields()
    if not found or "enforce_eager" not in ENGINE_FIELDS:
        return {
            "status": "not built",
            "reason": "the engine has no CUDA-graph option (looked for "
            + ", ".join(GRAPH_FIELDS)
            + "); enforce_eager is accepted but changes nothing",
        }
    out: dict[str, Any] = {"status": "built", "fields": found}
    if "enable_encoder_cuda_graph" in found:
        out["vit"] = compare_vit_graphs(profile)
    # Decode graphs: measured at the profile's batches (1, 8, 64) on the decode section's
    # checkpoint, captured at start-up vs --enforce-eager, both on the Triton backend (the only
    # capturable one). They exist on CUDA only. The graphs' run is the decode section's when it
    # captured them (one 7B engine fewer: ~40 s of the budget).
    if not profile.device.startswith("cuda"):
        out["skipped"] = f"decode CUDA graphs run on CUDA only; the device is {profile.device}"
    elif any(name != "enable_encoder_cuda_graph" for name in found):
        graphs = decode_with_graphs
        if not graphs or not graphs.get("cuda_graph_sizes") or "batches" not in graphs:
            graphs = measure_decode(profile, model_dir, limit_ms, attention_backend="triton")
        else:
            out["decode_graphs_from"] = "the decode section's triton run (same engine arguments)"
        eager = measure_decode(
            profile, model_dir, limit_ms, attention_backend="triton", enforce_eager=True
        )
        out["decode_graphs"], out["decode_eager"] = graphs, eager
        out["captured_sizes"] = graphs.get("cuda_graph_sizes")
        out["speedup_by_batch"] = {
            str(g["batch"]): e["ms_per_step"] / g["ms_per_step"]
            for g, e in zip(graphs["batches"], eager["batches"], strict=True)
            if g.get("ms_per_step") and e.get("ms_per_step")
        }
    # The engine refuses encoder graphs without CUDA (the smoke run): the tower figures above
    # then come from the eager stand-in.
    has_images = any(size for _, size in PROMPTS)
    if "enable_encoder_cuda_graph" in found and has_images and profile.device.startswith("cuda"):
        image_dir = image_model_dir or model_dir
        graphs = _image_run(profile, image_dir, enable_encoder_cuda_graph=True)
        eager = _image_run(profile, image_dir, enable_encoder_cuda_graph=False)
        out["encoder"] = {
            "checkpoint": image_dir.name,
            "graphs_s": graphs["seconds"],
            "eager_s": eager["seconds"],
            "speedup": eager["seconds"] / graphs["seconds"],
            "identical_tokens": graphs["tokens"] == eager["tokens"],
        }
    return out
