"""Randomized stress: arrivals, repeated images, aborts, errors, tiny budgets and caches,
preemption. Both managers are checked after every step; every request must finish and every
block and encoder slot must come back."""

from __future__ import annotations

import random
import zlib

import pytest

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.errors import InvalidRequestError
from mmserve.scheduling import Request
from mmserve.updates import RequestStatus
from tests.support.fake_runner import FakeRunner, admit, make_request, make_scheduler, run_step

EOS = 2
NUM_ARRIVAL_STEPS = 400
MAX_DRAIN_STEPS = 4000

CONFIGS = {
    "tiny-everything": dict(budget=24, item_cap=24, cache=None, blocks=24, bs=4, chunk_off=False),
    "tiny-cache": dict(budget=64, item_cap=40, cache=40, blocks=64, bs=8, chunk_off=False),
    "no-mm-chunking": dict(budget=48, item_cap=40, cache=80, blocks=40, bs=16, chunk_off=True),
    "no-prefix-cache": dict(budget=96, item_cap=32, cache=64, blocks=48, bs=8, chunk_off=False),
}


def _random_request(rng: random.Random, rid: str, item_cap: int, sizes: list[int]) -> Request:
    num_prompt = rng.randrange(1, 120)
    images, pos = [], rng.randrange(0, 12)
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        ident = rng.randrange(len(sizes))
        size = min(sizes[ident], item_cap)
        if pos + size > num_prompt:
            break
        images.append((f"img-{ident}-{size}", pos, size))
        pos += size + rng.randrange(0, 10)
    return make_request(
        rid,
        num_prompt,
        images,
        text_seed=rng.choice([0, 0, 1, 2]),  # shared text prefixes make prefix hits
        max_tokens=rng.randrange(1, 30),
        min_tokens=rng.choice([0, 0, 2]),
        ignore_eos=rng.random() < 0.2,
        cache_salt=rng.choice([None, None, "tenant-1"]),
    )


def _sampler(seed: int):
    def sample(request_id: str, position: int) -> int:
        r = random.Random(f"{seed}:{request_id}:{position}")
        return EOS if r.random() < 0.08 else r.randrange(3, 500)

    return sample


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_random_workload_finishes_within_budgets_and_returns_every_resource(name, seed):
    c = CONFIGS[name]
    rng = random.Random(seed)
    sched_config = SchedulerConfig(
        max_model_len=160,
        max_num_batched_tokens=c["budget"],
        max_num_seqs=6,
        max_tokens_per_mm_item=c["item_cap"],
        max_patches_per_mm_item=4 * c["item_cap"],  # the fake items: 4 patches per embed
        disable_chunked_mm_input=c["chunk_off"],
        encoder_cache_size=c["cache"],
    )
    cache_config = CacheConfig(
        num_blocks=c["blocks"],
        block_size=c["bs"],
        enable_prefix_caching=name != "no-prefix-cache",
    )
    scheduler = make_scheduler(sched_config, cache_config, eos_token_ids=[EOS])
    runner = FakeRunner(sched_config.effective_encoder_cache_size, c["bs"], _sampler(seed))
    sizes = [rng.randrange(1, c["item_cap"] + 8) for _ in range(8)]  # some are too large
    added, refused, finished = set(), 0, {}
    num_preemptions = 0

    for step in range(NUM_ARRIVAL_STEPS + MAX_DRAIN_STEPS):
        arriving = step < NUM_ARRIVAL_STEPS
        if not arriving and not scheduler.has_unfinished_requests():
            break
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2]) if arriving else 0):
            request = _random_request(rng, f"r{len(added) + refused}", c["item_cap"], sizes)
            try:
                admit(scheduler, request)  # the front end admits, then adds
                added.add(request.request_id)
            except InvalidRequestError:
                refused += 1
        if arriving and scheduler.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(scheduler.requests))
            status = rng.choice([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED])
            scheduler.finish_requests([victim], status)
            finished[victim] = status
        runner.fail_ids = {
            r for r in scheduler.requests if zlib.crc32(f"{seed}{r}".encode()) % 40 == 0
        }

        out, updates = run_step(scheduler, runner)
        assert out.total_num_scheduled_tokens <= sched_config.max_num_batched_tokens
        assert runner.last_step_encoded_patches <= sched_config.effective_encoder_patch_budget
        assert len(out.num_scheduled_tokens) <= sched_config.max_num_seqs
        assert len(scheduler.running) <= sched_config.max_num_seqs
        num_preemptions += len(out.preempted_req_ids)
        for update in updates:
            if update.finished:
                finished[update.request_id] = update.finish_status
    else:
        raise AssertionError(f"deadlock: {scheduler.get_num_unfinished_requests()} never finished")

    assert set(finished) == added and len(added) > 120
    assert scheduler.kv_cache_manager.num_free_blocks == c["blocks"]
    encoder = scheduler.encoder_cache_manager
    assert encoder.num_freeable_bytes == encoder.capacity_bytes
    assert all(not holders for holders in encoder.cached.values())
    scheduler.schedule()  # drain the last frees to the runner
    assert set(runner.encoder_cache) <= set(encoder.cached)
    if name == "tiny-everything":
        assert num_preemptions > 0 and refused > 0
    if name != "no-prefix-cache":
        assert scheduler.make_stats().prefix_cache_hits > 0
