"""Tensor parallelism (issue #34): decode throughput at TP=1 and, with two GPUs, at TP=2.

The same batch of text prompts, greedy, a fixed number of tokens each, through the offline
LLM; TP=2 runs its two ranks as processes on cuda:0 and cuda:1 (NCCL). With fewer than two
GPUs the TP=2 row says why it is absent.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.suite.llm_session import open_llm, resolved_fields
from benchmarks.suite.profile import Profile

from mmserve import SamplingParams


def measure_tensor_parallel(profile: Profile, model_dir: Path) -> dict[str, Any]:
    import torch

    num_gpus = torch.cuda.device_count() if profile.device == "cuda" else 0
    rows: dict[str, Any] = {"num_gpus": num_gpus, "tp1": _throughput(profile, model_dir, 1)}
    if num_gpus >= 2:
        rows["tp2"] = _throughput(profile, model_dir, 2)
        rows["tp2_over_tp1"] = rows["tp2"]["output_tok_per_s"] / rows["tp1"]["output_tok_per_s"]
    else:
        rows["tp2"] = {
            "absent": f"{num_gpus} GPU(s) on this machine ({profile.device}): TP=2 needs two "
            "(the CPU's gloo figure is in benchmarks/RESULTS.md)"
        }
    return rows


def _throughput(profile: Profile, model_dir: Path, tp: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=profile.tp_tokens, ignore_eos=True)
    prompts = [f"Count to {i}: one, two," for i in range(profile.tp_prompts)]
    with open_llm(profile, model_dir, profile.dtype, tensor_parallel_size=tp) as llm:
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up, not timed
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        fields = resolved_fields(llm)
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "tensor_parallel_size": tp,
        "num_prompts": profile.tp_prompts,
        "output_tokens": num_tokens,
        "seconds": seconds,
        "output_tok_per_s": num_tokens / seconds,
        **fields,
    }
