"""A Worker of a tensor-parallel rank builds its runner over the group: the runner gets the
rank's group and the encoder mode, and weights mode shards the vision tower (data mode keeps
it whole)."""

from __future__ import annotations

from pathlib import Path

import torch

from mmserve.execution.worker import Worker, WorkerConfig
from mmserve.layers.parallel import TPGroup
from mmserve.metrics import EngineMetrics
from tests.support.distributed import run_ranks


def _start(group: TPGroup, model_dir: Path, mode: str) -> tuple[int, int, str, int]:
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
        kv_cache_memory_bytes=1 << 20,
        mm_encoder_tp_mode=mode,
    )
    runner = Worker(config, EngineMetrics(), tp=group).start().runner
    tower = sum(p.numel() for p in runner.model.visual.parameters())
    return runner.tp.rank, runner.tp.size, runner.step_encoder.mode, tower


def _start_both(group: TPGroup, model_dir: Path) -> list[tuple[int, int, str, int]]:
    """Both modes' workers, one after the other, on one pair of rank processes (a spawn of
    two processes costs seconds): each builds its own runner over the same group."""
    return [_start(group, model_dir, mode) for mode in ("data", "weights")]


def test_a_ranks_worker_gives_its_runner_the_group_and_the_encoder_mode(
    qwen2_vl_dir: Path,
) -> None:
    data, weights = zip(*run_ranks(_start_both, 2, qwen2_vl_dir), strict=True)
    assert [d[:3] for d in data] == [(0, 2, "data"), (1, 2, "data")]
    assert [w[:3] for w in weights] == [(0, 2, "weights"), (1, 2, "weights")]
    assert weights[0][3] == weights[1][3] < data[0][3] == data[1][3]  # the tower's shard
