"""KV sizing by the profile run on a real CUDA device: the figures are sane and the KV cache it
sizes leaves room for the largest step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.execution.memory.device import CudaMemory
from mmserve.execution.memory.kv_sizing import CUDA_GRAPH_RESERVE_BYTES, size_kv_cache
from mmserve.execution.memory.profile import ProfileShape, profile_memory
from mmserve.layers.attention import select_backend
from mmserve.models.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block
from mmserve.models.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPE = ProfileShape(
    max_num_batched_tokens=4096,
    max_num_seqs=64,
    max_model_len=4096,
    max_patches_per_call=4 * 2048,
    max_tokens_per_mm_item=1024,
    block_size=16,
    max_logprobs=20,
)


def test_the_figures_are_sane_and_the_kv_cache_leaves_the_peak_free(qwen2_vl_dir: Path) -> None:
    device = torch.device("cuda")
    memory = CudaMemory(device)
    at_start = memory.snapshot()
    model, config = load_model(qwen2_vl_dir, device=device, dtype=torch.bfloat16)
    backend = select_backend("auto", device, block_size=SHAPE.block_size)

    def profile():
        return profile_memory(
            model, config, backend, SHAPE, memory, at_start, device=device, dtype=torch.bfloat16
        )

    figures = profile()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert figures.weights_bytes >= param_bytes
    assert figures.activation_peak_bytes > 0
    assert 0 < figures.free_bytes < figures.total_bytes
    bytes_per_block = kv_cache_bytes_per_block(config, SHAPE.block_size, torch.bfloat16)
    sizing = size_kv_cache(
        figures,
        utilization=0.25,  # other GPU tests may run beside this one
        bytes_per_block=bytes_per_block,
        encoder_cache_bytes=0,
        input_buffer_bytes=0,
        cuda_graph_reserve_bytes=CUDA_GRAPH_RESERVE_BYTES,
    )
    assert sizing.num_blocks > 0
    kv_caches = allocate_kv_caches(
        config, sizing.num_blocks, SHAPE.block_size, device, torch.bfloat16
    )
    try:
        free_after = memory.snapshot().free_bytes
        assert free_after >= figures.activation_peak_bytes + CUDA_GRAPH_RESERVE_BYTES
        again = profile()  # the largest step still runs beside the KV cache
        assert again.activation_peak_bytes <= figures.activation_peak_bytes * 1.1 + (1 << 20)
    finally:
        del kv_caches
        torch.cuda.empty_cache()


def test_an_engine_on_cuda_sizes_its_kv_cache_by_the_profile_run(qwen2_vl_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(model=str(qwen2_vl_dir), device="cuda", gpu_memory_utilization=0.25) as llm:
        assert llm.config.num_kv_blocks > 0
        out = llm.generate("Describe a red circle.", params)[0]
        assert len(out.outputs[0].token_ids) == 4
