"""DeepStack in the engine core's byte counts: a slot of the encoder cache is one encoder output
row, hidden x (1 + levels) x dtype size, and admission, the ledger and the pool's byte gauge
count every level (a Qwen2-VL config that declares levels stands in for Qwen3-VL)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.engine.core.build import encoder_embed_bytes
from mmserve.errors import EncoderItemTooLargeError
from mmserve.metrics import EngineMetrics, record_scheduler_stats
from mmserve.models.config import load_model_config
from mmserve.scheduling.admission import validate_request
from tests.support.deepstack import with_deepstack_levels
from tests.support.fake_runner import FakeRunner, make_request, make_scheduler

HIDDEN = 64  # the tiny checkpoints' text hidden size
NUM_EMBEDS = 24  # the test image's placeholder tokens


@pytest.fixture(scope="module")
def base_config(qwen2_vl_dir):
    config = load_model_config(qwen2_vl_dir)
    assert config.hidden_size == HIDDEN and config.deepstack_levels == 0
    return config


@pytest.mark.parametrize("levels", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_slot_is_one_row_of_every_level(base_config, levels, dtype):
    config = with_deepstack_levels(base_config, levels)
    assert config.deepstack_levels == levels
    assert encoder_embed_bytes(config, dtype) == HIDDEN * (1 + levels) * dtype.itemsize
    # no levels: what a slot was before DeepStack (hidden x dtype size)
    assert encoder_embed_bytes(base_config, dtype) == HIDDEN * dtype.itemsize


def _scheduler_config(row_bytes: int, **kwargs) -> SchedulerConfig:
    return SchedulerConfig(
        max_model_len=256, max_num_batched_tokens=64, encoder_embed_bytes=row_bytes, **kwargs
    )


def test_admission_counts_every_level(base_config):
    plain = encoder_embed_bytes(base_config, torch.bfloat16)
    deep = encoder_embed_bytes(with_deepstack_levels(base_config, 2), torch.bfloat16)
    request = make_request("r", 40, [("img", 4, NUM_EMBEDS)])
    cache = CacheConfig(num_blocks=64, block_size=16)
    # a cache that holds the item's main embeddings twice over, but not its 3 x wider rows
    cache_bytes = 2 * NUM_EMBEDS * plain
    args = (request.num_prompt_tokens, 4, request.mm_features)
    validate_request(*args, _scheduler_config(plain, encoder_cache_bytes=cache_bytes), cache)
    with pytest.raises(EncoderItemTooLargeError) as refused:
        validate_request(*args, _scheduler_config(deep, encoder_cache_bytes=cache_bytes), cache)
    needed = NUM_EMBEDS * HIDDEN * 3 * 2  # tokens x hidden x (1 + 2) x bf16
    assert f"needs {needed} bytes of encoder cache ({NUM_EMBEDS} embeddings)" in str(refused.value)
    assert f"holds {cache_bytes} bytes" in str(refused.value)


@pytest.mark.parametrize("levels", [0, 2])
def test_the_ledger_and_the_pool_bytes_gauge_count_every_level(base_config, levels):
    row_bytes = encoder_embed_bytes(with_deepstack_levels(base_config, levels), torch.float32)
    config = _scheduler_config(row_bytes)
    scheduler = make_scheduler(config, CacheConfig(num_blocks=64, block_size=16))
    runner = FakeRunner(config.effective_encoder_cache_size, 16)
    assert scheduler.encoder_cache_manager.capacity_bytes == 64 * row_bytes  # 64 slots
    local = make_request("local", 40, [("a", 4, NUM_EMBEDS)], max_tokens=4, ignore_eos=True)
    remote = make_request("remote", 20, [("b", 4, 8)], max_tokens=4, ignore_eos=True)
    remote.mm_features[0] = msgspec.structs.replace(remote.mm_features[0], is_remote=True)
    scheduler.add_request(local)
    scheduler.add_request(remote)
    per_row = HIDDEN * (1 + levels) * 4  # float32
    out = scheduler.schedule()  # "a" to encode here, "b" sent to the pool
    assert out.scheduled_encoder_inputs == {"local": [0]}
    assert [f.identifier for f in out.remote_encoder_inputs["remote"]] == ["b"]
    stats = scheduler.make_stats()
    assert stats.encoder_cache_used_bytes == (NUM_EMBEDS + 8) * per_row
    assert stats.encoder_inflight_bytes == 8 * per_row
    runner.deliver = {"b"}
    scheduler.update_from_output(out, runner.execute(out))  # "b" arrives
    scheduler.check_integrity()
    stats = scheduler.make_stats()
    assert stats.encoder_pool_bytes == 8 * per_row
    metrics = EngineMetrics()
    record_scheduler_stats(metrics, stats)
    assert metrics.snapshot().gauges["encoder_pool_bytes"] == 8 * per_row
