"""A seeded request draws the same tokens in-process, in two processes and across preemption."""

from __future__ import annotations

from pathlib import Path

from mmserve import LLM, SamplingParams
from tests.support.factory import random_image

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\n{IMG}What is in the image?<|im_end|>\n<|im_start|>assistant\n"


def _requests() -> list[dict]:
    return [
        {"prompt": PROMPT, "multi_modal_data": {"image": random_image(56, 84, seed=s)}}
        for s in range(6)
    ]


def _tokens(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(_requests(), params)]


def test_seeded_tokens_do_not_depend_on_process_or_preemption(qwen2_vl_dir: Path) -> None:
    params = [
        SamplingParams(temperature=1.0, top_p=0.95, seed=11 + i, max_tokens=24, ignore_eos=True)
        for i in range(6)
    ]
    model = str(qwen2_vl_dir)
    expected = _tokens(LLM(model=model, block_size=4), params)
    assert len({tuple(t) for t in expected}) > 1  # the seeds really sample
    # 6 requests of ~50 tokens each need ~78 blocks of 4: 40 forces preemptions
    tight = LLM(model=model, block_size=4, num_gpu_blocks_override=40)
    assert _tokens(tight, params) == expected
    assert tight.engine.metrics.snapshot().counters["num_preemptions"] > 0
    with LLM(model=model, block_size=4, num_gpu_blocks_override=40, multiprocess=True) as mp:
        assert _tokens(mp, params) == expected
        assert mp.engine.metrics.snapshot().counters["num_preemptions"] > 0
