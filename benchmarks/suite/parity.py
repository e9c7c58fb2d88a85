"""Greedy parity: mmserve against transformers on each checkpoint, and bf16 against fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from benchmarks.suite.llm_session import open_llm
from benchmarks.suite.profile import CheckpointSpec, Profile
from benchmarks.suite.timing import release_memory
from tests.support.factory import random_image
from tests.support.oracle import HFOracle

from mmserve import SamplingParams

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def _prompt(text: str) -> str:
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    )


# One text-only prompt and one with an image (the ViT, the splice and M-RoPE in the path).
PROMPTS = (
    (_prompt("Describe a red circle."), None),
    (_prompt(f"{IMG}What is in the image?"), (448, 336)),
)


def _requests() -> list[tuple[str, list]]:
    return [(p, [random_image(*size, seed=7)] if size else []) for p, size in PROMPTS]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token over the shorter length; None when they agree."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def mmserve_tokens(profile: Profile, model_dir: Path, dtype: str) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=profile.parity_tokens, ignore_eos=True)
    requests = [
        {"prompt": p, "multi_modal_data": {"image": imgs[0]}} if imgs else {"prompt": p}
        for p, imgs in _requests()
    ]
    with open_llm(profile, model_dir, dtype) as llm:
        outs = llm.generate(requests, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def hf_tokens(
    profile: Profile, model_dir: Path, dtype: str, ours: list[list[int]] | None = None
) -> tuple[list[list[int]], list[dict[str, Any] | None]]:
    """transformers' greedy tokens per prompt and, where `ours` diverges from them, its margins
    there (`divergence_margin`)."""
    oracle = HFOracle(model_dir, dtype=getattr(torch, dtype), device=profile.device)
    try:
        requests = _requests()
        theirs = [oracle.greedy(p, imgs, profile.parity_tokens) for p, imgs in requests]
        margins: list[dict[str, Any] | None] = []
        for (prompt, imgs), a, b in zip(requests, ours or [], theirs, strict=False):
            i = first_divergence(a, b)
            margins.append(
                None if i is None else divergence_margin(oracle, prompt, imgs, b[:i], a[i], b[i])
            )
        return theirs, margins
    finally:
        del oracle
        release_memory(profile.device)


def divergence_margin(
    oracle: HFOracle, prompt: str, images: list, prefix: list[int], ours: int, theirs: int
) -> dict[str, Any]:
    """How far apart the two tokens are in transformers' own logits at the first divergence:
    a gap of a few units in the last place of the top logit's dtype is a near-tie that rounding
    decides (random weights give flat logits), a wide gap is a bug in one of the two."""
    logits = oracle.next_logits(prompt, images, prefix)
    top = float(logits.max())
    ulp = 2.0 ** (torch.floor(torch.log2(torch.tensor(abs(top) or 1.0))).item() - 7)  # bf16
    gap = float(logits[theirs] - logits[ours])
    return {
        "index": len(prefix),
        "top_logit": top,
        "gap_theirs_minus_ours": gap,
        "bf16_ulp_at_top": ulp,
        "gap_in_bf16_ulps": gap / ulp,
        "logit_std": float(logits.std()),
        "ours_rank": int((logits > logits[ours]).sum()),
    }


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    divergences = [first_divergence(x, y) for x, y in zip(a, b, strict=True)]
    return {
        "identical": all(d is None for d in divergences),
        "first_divergence": divergences,  # per prompt: token index, or None
    }


def check_parity(profile: Profile, spec: CheckpointSpec, model_dir: Path) -> dict[str, Any]:
    ours = mmserve_tokens(profile, model_dir, profile.dtype)
    theirs, margins = hf_tokens(profile, model_dir, profile.dtype, ours)
    result: dict[str, Any] = {
        "dtype": profile.dtype,
        "tokens_compared": profile.parity_tokens,
        "prompts": [
            ("image " if size else "text ") + p.split("user\n")[1][:40] for p, size in PROMPTS
        ],
        "mmserve_vs_transformers": _agreement(ours, theirs),
        "divergence_margins": margins,  # per prompt, in transformers' logits; None: identical
        "mmserve_tokens": ours,
        "transformers_tokens": theirs,
    }
    if not spec.check_fp32:
        result["bf16_vs_fp32"] = {
            "skipped": "a float32 copy of this shape would not fit the "
            "time budget (checked on the smaller checkpoints)"
        }
        return result
    low = "bfloat16"
    ours_low = ours if profile.dtype == low else mmserve_tokens(profile, model_dir, low)
    ours_fp32 = (
        ours if profile.dtype == "float32" else mmserve_tokens(profile, model_dir, "float32")
    )
    theirs_low = theirs if profile.dtype == low else hf_tokens(profile, model_dir, low)[0]
    theirs_fp32 = (
        theirs if profile.dtype == "float32" else hf_tokens(profile, model_dir, "float32")[0]
    )
    # transformers' own bf16-vs-fp32 agreement is the baseline: random weights give flat logits,
    # so an early divergence in both is rounding, one in mmserve alone is a bug.
    result["bf16_vs_fp32"] = {
        "mmserve": _agreement(ours_low, ours_fp32),
        "transformers": _agreement(theirs_low, theirs_fp32),
        # The decisive check where bf16 diverges: in float32 the two must still agree.
        "mmserve_vs_transformers_fp32": _agreement(ours_fp32, theirs_fp32),
    }
    return result
