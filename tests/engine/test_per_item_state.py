"""Nothing keyed by a request or by a picture outlives what the caches' budgets allow.

A long run of new pictures must leave per-request maps empty and per-item maps no larger than
their cache, or the server's memory grows with every new picture (issue #20).
"""

from __future__ import annotations

import io
import random

from mmserve import LLM, SamplingParams
from tests.support.factory import random_image

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def _png(seed: int) -> bytes:
    rng = random.Random(seed)
    buf = io.BytesIO()
    random_image(rng.randint(28, 200), rng.randint(28, 200), seed=seed).save(buf, format="PNG")
    return buf.getvalue()


def test_new_pictures_leave_no_per_request_state_and_bounded_per_item_state() -> None:
    llm = LLM(  # the bundled toy model; small caches so that every one of them evicts
        mm_processor_cache_gb=0.001,
        encoder_cache_size=64,
        num_gpu_blocks_override=64,
        block_size=4,
        max_num_seqs=4,
    )
    engine = llm.engine
    processor = engine.input_processor
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    request_ids = []
    for i in range(40):
        prompt = f"<|im_start|>user\n{IMG}what shape?<|im_end|>\n<|im_start|>assistant\n"
        item = {"prompt": prompt, "multi_modal_data": {"image": [_png(i)]}}
        rid = f"r{i}"
        request_ids.append(rid)
        engine.add_request(rid, processor.process_generate_input(item), params)
        if i % 7 == 3:
            engine.abort_requests([rid])
        for _ in range(2):
            engine.step()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    scheduler, runner = engine.core.scheduler, engine.core.executor.runner
    # per request: nothing left anywhere. NOTE: the runner hears of requests that finished in
    # the last step at the next one, so until then it keeps at most one batch of them.
    assert not scheduler.requests and len(runner.states) <= 4
    engine.step()
    assert not runner.states
    assert not any(rid in engine.output_processor for rid in request_ids)
    assert all(scheduler.kv_cache_manager.block_ids(rid) == [] for rid in request_ids)
    # per picture: the runner holds no embedding the encoder cache manager has evicted
    manager = scheduler.encoder_cache_manager
    assert len(runner.encoder_cache) <= len(manager.cached)
    assert runner.encoder_cache.num_bytes <= manager.num_used_bytes <= manager.capacity_bytes
    assert processor.cache.used_bytes <= processor.cache.capacity_bytes
    assert processor.media_loader.decode_gate.in_use_bytes == 0  # every decoded image is gone
    scheduler.check_integrity()
    processor.cache.check_integrity()
