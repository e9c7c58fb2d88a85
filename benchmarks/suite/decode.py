"""Decode ms per step through mmserve's engine at batch 1, 8 and 64, against the weight-read limit.

One step at batch B reads every language-model weight once (B tokens for one weight read), so
at batch 1 the floor is weight bytes / measured bandwidth. The step time is the difference of
two runs of the same batch that differ only in max_tokens, divided by the extra steps: prefill,
admission and start-up cancel out.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.suite.llm_session import ENGINE_FIELDS, open_llm, resolved_fields
from benchmarks.suite.profile import Profile
from benchmarks.suite.timing import synchronize

from mmserve import LLM, SamplingParams
from mmserve.config import device as device_config

# The backend names issue #15 gives `--attention-backend`, unless the device config lists its
# own; "auto" is left out, it would repeat one of the others.
ATTENTION_BACKENDS = tuple(
    name
    for name in getattr(device_config, "ATTENTION_BACKENDS", ("torch", "triton"))
    if name != "auto"
)


def attention_backends(device: str) -> tuple[str, ...]:
    """Every backend on CUDA; on a CPU only torch (Triton kernels run there only under the
    interpreter, which their own tests in tests/layers exercise)."""
    return ATTENTION_BACKENDS if device == "cuda" else ("torch",)


def _prompts(batch: int, num_words: int, run: int) -> list[str]:
    # Distinct per request and per run, and prefix caching off: no run reuses another's prefill.
    return [
        f"run {run} request {i}: " + "tell me a story " * (num_words // 4) for i in range(batch)
    ]


def _run_seconds(llm: LLM, prompts: list[str], max_tokens: int, device: str) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    synchronize(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    synchronize(device)
    if any(len(o.outputs[0].token_ids) != max_tokens for o in outs):
        raise RuntimeError(f"a request stopped before max_tokens={max_tokens} (ignore_eos)")
    return time.perf_counter() - start


def step_ms(llm: LLM, profile: Profile, batch: int, run: int) -> float | None:
    """The fastest of `decode_repeats` estimates; None when noise swamped every one (the long
    run was not slower than the short one, which happens only for tiny CPU models)."""
    short, long = profile.decode_steps
    words = profile.decode_prompt_tokens
    estimates = []
    start = time.perf_counter()
    for rep in range(profile.decode_repeats):
        if rep and time.perf_counter() - start > profile.decode_batch_cap_s:
            break  # a slow engine gets one estimate per batch, not the budget of later sections
        tag = 2 * (run * profile.decode_repeats + rep)
        short_s = _run_seconds(llm, _prompts(batch, words, tag), short, profile.device)
        long_s = _run_seconds(llm, _prompts(batch, words, tag + 1), long, profile.device)
        if long_s > short_s:
            estimates.append((long_s - short_s) / (long - short) * 1e3)
    return min(estimates) if estimates else None


def measure_decode(
    profile: Profile, model_dir: Path, limit_ms: float | None, **engine_extra: Any
) -> dict[str, Any]:
    """ms per decode step for each batch size of the profile, with `engine_extra` LLM keywords."""
    rows = []
    max_seqs = max(profile.decode_batches)
    with open_llm(
        profile,
        model_dir,
        profile.dtype,
        max_num_seqs=max_seqs,
        enable_prefix_caching=False,
        **engine_extra,
    ) as llm:
        # Warm-up at the largest batch, not timed: the allocator and kernels' first calls.
        _run_seconds(llm, _prompts(max_seqs, 8, -1), profile.decode_steps[0], profile.device)
        for run, batch in enumerate(profile.decode_batches):
            ms = step_ms(llm, profile, batch, run)
            row: dict[str, Any] = {"batch": batch, "ms_per_step": ms}
            if ms is not None:
                row["tokens_per_s"] = batch * 1e3 / ms
                if limit_ms:
                    row["x_weight_read_limit"] = ms / limit_ms
            rows.append(row)
        resolved = resolved_fields(llm)
    return {
        "engine_args": engine_extra,
        "batches": rows,
        # the decode graphs the engine captured at start-up (empty: every step ran eagerly)
        "cuda_graph_sizes": list(resolved["cuda_graph_sizes"] or ()),
        "resolved": resolved,
    }


def decode_section(profile: Profile, model_dir: Path, checkpoint: dict, peaks: dict) -> dict:
    gb_per_s = peaks.get("bandwidth", {}).get("gb_per_s")
    limit = {
        "bandwidth_gb_per_s": gb_per_s,
        "lm_bytes": checkpoint["lm_bytes"],
        "lm_bytes_per_decode_step": checkpoint["lm_bytes_per_decode_step"],
    }
    limit_ms = None
    if gb_per_s:
        # The convention (the whole LM, 15.2 GB at 7B shape) is the goal's; the stricter
        # floor without the embedding table is recorded beside it.
        limit_ms = checkpoint["lm_bytes"] / (gb_per_s * 1e9) * 1e3
        limit["limit_ms"] = limit_ms
        limit["limit_ms_without_embedding"] = (
            checkpoint["lm_bytes_per_decode_step"] / (gb_per_s * 1e9) * 1e3
        )
    out: dict[str, Any] = {
        "checkpoint": {k: checkpoint[k] for k in ("layers", "hidden_size", "vocab_size")},
        "depth": f"full ({checkpoint['layers']} layers)",
        "weight_read_limit": limit,
        "steps": {"short": profile.decode_steps[0], "long": profile.decode_steps[1]},
        "prompt_words": profile.decode_prompt_tokens,
    }
    if "attention_backend" in ENGINE_FIELDS:
        out["backends"] = {}
        for backend in attention_backends(profile.device):
            try:
                out["backends"][backend] = measure_decode(
                    profile, model_dir, limit_ms, attention_backend=backend
                )
            except Exception as exc:  # one backend failing must not hide the other's figures
                out["backends"][backend] = {"error": f"{type(exc).__name__}: {exc}"}
    else:
        out["backends"] = {"torch": measure_decode(profile, model_dir, limit_ms)}
        out["backends_note"] = "the engine has no attention_backend: only the torch path exists"
    return out
