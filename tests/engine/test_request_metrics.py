"""Per-request metrics through a real engine: phases, finish reasons and preemptions, with the
engine core in this process and in its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmserve import LLM
from mmserve.metrics import PHASE_HISTOGRAMS
from mmserve.multimodal import ProcessedPrompt
from mmserve.sampling_params import SamplingParams


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in_process", "engine_process"])
def test_preempted_requests_are_counted_once_each_with_their_phases(
    qwen2_vl_dir: Path, multiprocess: bool
) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [f"request number {i} asks a question" for i in range(4)]
    # Blocks of 4 tokens: each request grows to ~9 blocks, 12 cannot hold them all at once.
    with LLM(
        model=str(qwen2_vl_dir),
        block_size=4,
        num_gpu_blocks_override=12,
        multiprocess=multiprocess,
    ) as llm:
        outputs = llm.generate(prompts, params)
        snap = llm.engine.metrics.snapshot()
    assert snap.counters["num_preemptions"] > 0  # counted by the core, mirrored if remote
    assert snap.request_success == {"stop": 0, "length": 4, "abort": 0, "error": 0}
    h = snap.histograms
    for name in PHASE_HISTOGRAMS:
        assert h[name].num == len(prompts), name
    assert h["request_generation_tokens"].total == 4 * 24
    prompt_total = sum(len(o.prompt_token_ids) for o in outputs)
    assert h["request_prompt_tokens"].total == prompt_total == snap.counters["prompt_tokens"]
    e2e = h["e2e_request_latency_seconds"].total
    queue = h["request_queue_time_seconds"].total
    inference = h["request_inference_time_seconds"].total
    assert queue >= 0 and inference > 0 and queue + inference <= e2e


def test_a_request_aborted_before_it_ran_counts_as_abort_with_no_queue_time(qwen2_vl_dir):
    with LLM(model=str(qwen2_vl_dir)) as llm:
        engine = llm.engine
        engine.add_request("r", ProcessedPrompt(prompt_token_ids=[5, 6, 7]), SamplingParams())
        (final,) = engine.abort_requests(["r"])
        snap = engine.metrics.snapshot()
    assert final.outputs[0].finish_reason == "abort"
    assert snap.request_success["abort"] == 1
    h = snap.histograms
    assert h["e2e_request_latency_seconds"].num == 1
    assert h["request_queue_time_seconds"].num == 0  # it was never scheduled
    assert h["request_prompt_tokens"].total == 3
    assert h["request_generation_tokens"].num == 1 and h["request_generation_tokens"].total == 0
