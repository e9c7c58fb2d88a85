"""Replicas of a tensor-parallel model: `-dp 2 -tp 2` (two engine processes, two gloo ranks
each, every group on ports of its own) answers as one device does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mmserve import LLM, SamplingParams
from mmserve.config.engine import EngineConfig
from mmserve.config.parallel import ParallelConfig
from mmserve.engine.frontend.async_engine import build_async_engine
from mmserve.engine.frontend.replica_restart import replica_env
from mmserve.engine.frontend.replicas import ReplicaSet
from tests.support.factory import png_bytes
from tests.support.harness import data_url, image_part, user

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# a small KV cache: zeroing the CPU default (2 GiB) costs each of the five engines seconds
SMALL_KV = {"kv_cache_memory_bytes": 16 << 20}


def test_two_tensor_parallel_replicas_answer_as_one_device(qwen2_vl_dir: Path) -> None:
    conversations = [
        user(image_part(data_url(png_bytes(56, 56, seed=i))), f"Q{i}?") for i in range(4)
    ]
    config = EngineConfig.from_kwargs(
        model=str(qwen2_vl_dir), data_parallel_size=2, tensor_parallel_size=2, **SMALL_KV
    )
    engine = build_async_engine(config)
    try:
        core = engine.engine.core
        assert isinstance(core, ReplicaSet) and len(core.replica_metrics) == 2

        async def ask(i: int) -> list[int]:
            prompt = await engine.process_chat(conversations[i])
            final = None
            async for out in engine.generate(prompt, PARAMS, f"dptp-{i}"):
                final = out
            assert final is not None and final.finished
            return list(final.outputs[0].token_ids)

        async def ask_all() -> list[list[int]]:
            return await asyncio.gather(*(ask(i) for i in range(len(conversations))))

        got = asyncio.run(ask_all())
        served = [m.snapshot().counters["encoder_items_encoded"] for m in core.replica_metrics]
    finally:
        asyncio.run(engine.shutdown(timeout_s=10))
    with LLM(model=str(qwen2_vl_dir), **SMALL_KV) as single:
        expected = [list(o.outputs[0].token_ids) for o in single.chat(conversations, PARAMS)]
    assert got == expected
    assert sum(served) >= len(conversations)  # every picture was encoded by some replica


def test_replicas_of_tensor_parallel_groups_refuse_one_rendezvous_port() -> None:
    with pytest.raises(ValueError, match="drop --nnodes and --master-port"):
        ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, master_port=29500)


def test_each_replica_sees_its_own_group_of_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineConfig.from_kwargs(
        model="unused", device="cuda", data_parallel_size=2, tensor_parallel_size=2
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert [replica_env(config, i) for i in range(2)] == [
        {"CUDA_VISIBLE_DEVICES": "4,5"},
        {"CUDA_VISIBLE_DEVICES": "6,7"},
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(ValueError, match="needs 2 GPU"):
        replica_env(config, 1)
