"""Randomized engine run on the real tiny model: arrivals, aborts, tiny budgets and caches.

Every step the scheduler's invariants hold; every request ends; at the end every KV block and
encoder slot is free; and each request that finished normally produced exactly the tokens it
produces when run alone (batching, chunking, preemption and caching change nothing).
"""

from __future__ import annotations

import random

from mmserve import LLM, SamplingParams
from tests.support.factory import random_image

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
WORDS = [
    "red",
    "blue",
    "green",
    "circle",
    "square",
    "star",
    "left",
    "right",
    "top",
    "bottom",
    "image",
    "picture",
    "what",
    "is",
]


def _random_request(rng: random.Random, pictures: list) -> dict | str:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
    images = rng.sample(pictures, rng.randint(0, 2))
    prompt = f"<|im_start|>user\n{IMG * len(images)}{text}<|im_end|>\n<|im_start|>assistant\n"
    return {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt


def test_random_arrivals_aborts_and_tiny_budgets(qwen2_vl_dir):
    rng = random.Random(0)
    pictures = [
        random_image(rng.choice([28, 56, 84]), rng.choice([56, 112]), seed=s) for s in range(5)
    ]
    llm = LLM(
        model=str(qwen2_vl_dir),
        max_num_batched_tokens=24,
        max_num_seqs=4,
        block_size=4,
        num_gpu_blocks_override=48,
        encoder_cache_size=1,  # floored at the largest item: entries get evicted all the time
        mm_processor_kwargs={"max_pixels": 112 * 112},
    )
    engine = llm.engine
    processor = engine.input_processor
    requests: dict[str, tuple[dict | str, SamplingParams]] = {}
    finished: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for step in range(400):
        if step < 250 and rng.random() < 0.3:
            rid = f"r{len(requests)}"
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 6), ignore_eos=True)
            requests[rid] = (_random_request(rng, pictures), params)
            engine.add_request(rid, processor.process_generate_input(requests[rid][0]), params)
        if rng.random() < 0.05 and engine.core.scheduler.requests:
            victim = rng.choice(sorted(engine.core.scheduler.requests))
            engine.abort_requests([victim])
            aborted.add(victim)
        for out in engine.step():
            if out.finished:
                assert out.outputs[0].finish_reason in ("length", "abort"), out.error
                finished[out.request_id] = out.outputs[0].token_ids
        engine.core.scheduler.check_integrity()
        if step >= 250 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests(), "requests left over: the scheduler is stuck"
    assert set(finished) | aborted == set(requests)
    stats = engine.core.scheduler.make_stats()
    assert stats.num_free_kv_blocks == 48
    assert stats.encoder_cache_used_slots == 0
    assert len(requests) > 40 and len(aborted) > 0
    # every normally finished request equals a run of it alone
    alone = LLM(model=str(qwen2_vl_dir), mm_processor_kwargs={"max_pixels": 112 * 112})
    done = [rid for rid in requests if rid in finished and rid not in aborted]
    outs = alone.generate([requests[r][0] for r in done], [requests[r][1] for r in done])
    for rid, out in zip(done, outs, strict=True):
        assert finished[rid] == out.outputs[0].token_ids, rid
