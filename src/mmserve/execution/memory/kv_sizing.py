"""How many KV blocks fit on a GPU: the start-up profile's figures in, blocks out.

vLLM's rule: this process may use `--gpu-memory-utilization` of the device's memory; the
weights, the profile run's activation peak, the memory held outside torch's allocator, the
encoder cache, the runner's input buffers and a reserve for CUDA graphs come off it, and the KV
cache gets the rest. It never gets more than is free now less what is still to be allocated
(another process may hold memory too).

    utilization x total ─┬─ weights
                         ├─ activation peak (the profile run: ViT at the encoder budget,
                         │                    LM at --max-num-batched-tokens, the sampler
                         │                    over --max-num-seqs rows at its costliest)
                         ├─ non-torch (cuBLAS workspaces, ... grown since start-up)
                         ├─ encoder cache (embeddings kept on the device, full)
                         ├─ input buffers (the runner's persistent device buffers, built later)
                         ├─ CUDA graph reserve (decode graphs, captured after the KV cache)
                         └─ KV cache  = num_blocks x bytes_per_block (+ < 1 block unused)

NOTE: the encoder CUDA graphs (--enable-encoder-cuda-graph) are captured lazily, later, in one
shared pool; their largest budget is the full encoder budget, which the profile's ViT run
covers, so its peak bounds them and they need no reserve of their own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from mmserve.execution.graphs.decode import CUDA_GRAPH_RESERVE_BYTES
from mmserve.execution.memory.device import DeviceMemory, MemorySnapshot
from mmserve.execution.memory.profile import MemoryFigures, ProfileShape, profile_memory
from mmserve.layers.attention import AttentionBackend
from mmserve.layers.parallel import SINGLE, TPGroup
from mmserve.models.config import ModelConfig

__all__ = ["CUDA_GRAPH_RESERVE_BYTES", "GpuProfile", "profiled_kv_budget", "size_kv_cache"]

MIB = 1 << 20

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSizing:
    """The KV cache a GPU gets, with every figure that decided it (bytes unless named)."""

    figures: MemoryFigures
    utilization: float
    encoder_cache_bytes: int
    input_buffer_bytes: int
    cuda_graph_reserve_bytes: int
    bytes_per_block: int
    kv_cache_bytes: int  # num_blocks x bytes_per_block
    num_blocks: int
    is_limited_by_free_memory: bool  # the free-memory bound was the smaller one

    def describe(self) -> str:
        f = self.figures
        bound = "free memory" if self.is_limited_by_free_memory else "utilization"
        return (
            f"KV cache: {self.num_blocks} blocks = {self.kv_cache_bytes // MIB} MiB "
            f"({self.bytes_per_block // 1024} KiB per block, limited by {bound}) = "
            f"{self.utilization:.2f} x {f.total_bytes // MIB} MiB total "
            f"- weights {f.weights_bytes // MIB} MiB "
            f"- activation peak {f.activation_peak_bytes // MIB} MiB "
            f"- non-torch {f.non_torch_bytes // MIB} MiB "
            f"- encoder cache {self.encoder_cache_bytes // MIB} MiB "
            f"- input buffers {self.input_buffer_bytes / MIB:.1f} MiB "
            f"- CUDA graph reserve {self.cuda_graph_reserve_bytes // MIB} MiB "
            "(decode graphs; measured after capture); "
            f"{f.free_bytes // MIB} MiB free after the profile run"
        )


def size_kv_cache(
    figures: MemoryFigures,
    *,
    utilization: float,
    bytes_per_block: int,
    encoder_cache_bytes: int,
    input_buffer_bytes: int,
    cuda_graph_reserve_bytes: int,
) -> KVCacheSizing:
    """The module docstring's rule; ValueError naming what to lower when no block fits."""
    assert 0 < utilization <= 1 and bytes_per_block > 0
    to_allocate_bytes = (
        figures.activation_peak_bytes
        + encoder_cache_bytes
        + input_buffer_bytes
        + cuda_graph_reserve_bytes
    )
    held_bytes = figures.weights_bytes + figures.non_torch_bytes + to_allocate_bytes
    by_utilization = int(utilization * figures.total_bytes) - held_bytes
    # The weights are already out of the free figure; what runs later must still fit.
    by_free_memory = figures.free_bytes - to_allocate_bytes
    kv_bytes = min(by_utilization, by_free_memory)
    num_blocks = max(0, kv_bytes) // bytes_per_block
    sizing = KVCacheSizing(
        figures=figures,
        utilization=utilization,
        encoder_cache_bytes=encoder_cache_bytes,
        input_buffer_bytes=input_buffer_bytes,
        cuda_graph_reserve_bytes=cuda_graph_reserve_bytes,
        bytes_per_block=bytes_per_block,
        kv_cache_bytes=num_blocks * bytes_per_block,
        num_blocks=num_blocks,
        is_limited_by_free_memory=by_free_memory < by_utilization,
    )
    if num_blocks < 1:
        raise ValueError(
            f"no KV cache block ({bytes_per_block} bytes) fits on the GPU: {sizing.describe()}. "
            "Lower --max-num-batched-tokens (the activation peak scales with it) or "
            "--max-model-len, shrink the encoder budget (--encoder-cache-size, "
            "--mm-processor-kwargs max_pixels) or --max-num-seqs (the sampler's peak scales "
            "with it), raise --gpu-memory-utilization, or free the memory other processes "
            "hold on this GPU"
        )
    return sizing


@dataclass(frozen=True)
class GpuProfile:
    """What the profile run needs: the loaded model, its attention, the largest step, the
    device snapshot taken before the weights were loaded, and the rank's tensor-parallel group
    (its dummy KV cache holds its KV heads; every rank of a group runs the profile together)."""

    model: nn.Module
    model_config: ModelConfig
    attention_backend: AttentionBackend
    shape: ProfileShape
    at_start: MemorySnapshot
    device: torch.device
    dtype: torch.dtype
    tp: TPGroup = SINGLE


def profiled_kv_budget(
    gpu: GpuProfile,
    memory: DeviceMemory,
    *,
    utilization: float,
    bytes_per_block: int,
    encoder_cache_bytes: int,
    input_buffer_bytes: int,
    has_cuda_graphs: bool,
    has_encoder_cuda_graphs: bool,
) -> int:
    """The profile run (`profile.py`), then `size_kv_cache`; logs the figures."""
    figures = profile_memory(
        gpu.model,
        gpu.model_config,
        gpu.attention_backend,
        gpu.shape,
        memory,
        gpu.at_start,
        device=gpu.device,
        dtype=gpu.dtype,
        tp=gpu.tp,
    )
    logger.info(
        "profile run on %s: ViT on grids %s, LM over %s new tokens, its head and the sampler "
        "(top-k, top-p, penalties, %d logprobs) on %d rows: activation peak %d MiB",
        gpu.device,
        list(figures.encoder_grids),
        "+".join(map(str, figures.lm_seq_lens)),
        gpu.shape.max_logprobs,
        figures.num_sampled_rows,
        figures.activation_peak_bytes // MIB,
    )
    if has_encoder_cuda_graphs:
        logger.info(
            "encoder CUDA graphs: captured lazily in one shared pool, at most the full encoder "
            "budget (%d patches): the profile's ViT peak above bounds them, no reserve kept",
            gpu.shape.max_patches_per_call,
        )
    sizing = size_kv_cache(
        figures,
        utilization=utilization,
        bytes_per_block=bytes_per_block,
        encoder_cache_bytes=encoder_cache_bytes,
        input_buffer_bytes=input_buffer_bytes,
        cuda_graph_reserve_bytes=CUDA_GRAPH_RESERVE_BYTES if has_cuda_graphs else 0,
    )
    logger.info("%s", sizing.describe())
    return sizing.kv_cache_bytes
