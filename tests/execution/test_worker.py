"""The worker's start-up recipe on the CPU: the KV cache it sizes and allocates, the runner it
builds, and the caller's process left as it was."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from mmserve.config.scheduler import CPU_KV_CACHE_BYTES
from mmserve.execution.worker import Worker, WorkerConfig
from mmserve.layers.parallel import TPGroup
from mmserve.metrics import EngineMetrics
from mmserve.models.config import load_model_config
from mmserve.models.kv_cache import kv_cache_bytes_per_block


def _config(model_dir: Path, **overrides) -> WorkerConfig:
    config = WorkerConfig(
        model_dir=model_dir,
        device=torch.device("cpu"),
        dtype=torch.float32,
        attention_backend="torch",
        seed=0,
        max_model_len=64,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        max_tokens_per_mm_item=16,
        max_patches_per_call=256,
        encoder_cache_bytes=1 << 20,
        max_logprobs=5,
        mm_reencode_cache_bytes=0,
        block_size=16,
    )
    return dataclasses.replace(config, **overrides)


def _bytes_per_block(model_dir: Path) -> int:
    return kv_cache_bytes_per_block(load_model_config(model_dir), 16, torch.float32)


def test_the_budget_in_blocks_is_allocated_one_cache_per_layer(qwen2_vl_dir: Path) -> None:
    per_block = _bytes_per_block(qwen2_vl_dir)
    config = _config(qwen2_vl_dir, kv_cache_memory_bytes=5 * per_block + per_block // 2)
    started = Worker(config, EngineMetrics()).start()
    assert started.num_blocks == 5 and started.bytes_per_block == per_block
    text = started.model_config.text
    caches = started.runner.kv_caches
    assert len(caches) == text.num_hidden_layers
    assert caches[0].shape == (2, 5, 16, text.num_key_value_heads, text.head_dim)
    assert started.attention_backend == "torch" and started.layer_ops == "torch"
    assert started.cuda_graph_sizes == () and not started.encoder_cuda_graph
    assert started.runner.buffers.limits.max_blocks_per_seq == 4  # 64 tokens in blocks of 16


def test_never_more_blocks_than_every_sequence_at_full_length_needs(qwen2_vl_dir: Path) -> None:
    assert _bytes_per_block(qwen2_vl_dir) * 16 < CPU_KV_CACHE_BYTES  # the CPU default is ample
    started = Worker(_config(qwen2_vl_dir), EngineMetrics()).start()
    assert started.num_blocks == 4 * 4  # max_num_seqs x ceil(max_model_len / block_size)


def test_the_override_wins_and_a_budget_without_a_block_is_refused(qwen2_vl_dir: Path) -> None:
    config = _config(qwen2_vl_dir, num_gpu_blocks_override=3, kv_cache_memory_bytes=1)
    assert Worker(config, EngineMetrics()).start().num_blocks == 3
    with pytest.raises(ValueError, match="holds no block.*--kv-cache-memory-bytes"):
        Worker(_config(qwen2_vl_dir, kv_cache_memory_bytes=100), EngineMetrics()).start()


def test_start_up_leaves_the_callers_random_state_alone(qwen2_vl_dir: Path) -> None:
    before = torch.random.get_rng_state()
    Worker(_config(qwen2_vl_dir, seed=1234), EngineMetrics()).start()
    assert torch.equal(torch.random.get_rng_state(), before)


def test_a_tensor_parallel_rank_sizes_and_allocates_its_own_kv_heads(qwen2_vl_dir: Path) -> None:
    rank = TPGroup(rank=1, size=2, group=object())  # start-up runs no collective on the CPU
    per_block = _bytes_per_block(qwen2_vl_dir) // 2  # 1 of the 2 KV heads
    config = _config(qwen2_vl_dir, kv_cache_memory_bytes=5 * per_block)
    started = Worker(config, EngineMetrics(), tp=rank).start()
    assert started.num_blocks == 5 and started.bytes_per_block == per_block
    head_dim = started.model_config.text.head_dim
    assert started.runner.kv_caches[0].shape == (2, 5, 16, 1, head_dim)
