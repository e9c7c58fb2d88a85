"""How many KV blocks fit on a GPU: the start-up profile's figures in, blocks out.

vLLM's rule: this process may use `--gpu-memory-utilization` of the device's memory; the
weights, the profile run's activation peak, the memory held outside torch's allocator, the
encoder cache and a reserve for CUDA graphs come off it, and the KV cache gets the rest. It
never gets more than is free now less the activations and the reserve (another process may
hold memory too).

    utilization x total ─┬─ weights (and persistent buffers)
                         ├─ activation peak (the profile run: ViT at the encoder budget,
                         │                    LM at --max-num-batched-tokens)
                         ├─ non-torch (cuBLAS workspaces, ... grown since start-up)
                         ├─ encoder cache (embeddings kept on the device, full)
                         ├─ CUDA graph reserve
                         └─ KV cache  = num_blocks x bytes_per_block (+ < 1 block unused)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from mmserve.execution.device_memory import DeviceMemory, MemorySnapshot
from mmserve.execution.memory_profile import MemoryFigures, ProfileShape, profile_memory
from mmserve.layers.attention import AttentionBackend
from mmserve.models.config import ModelConfig

MIB = 1 << 20
# Kept free for the decode CUDA graphs' memory pool (unless --enforce-eager) until their capture
# measures it: a decode step's activations at the largest captured batch are tens of MiB.
CUDA_GRAPH_RESERVE_BYTES = 256 * MIB

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSizing:
    """The KV cache a GPU gets, with every figure that decided it (bytes unless named)."""

    figures: MemoryFigures
    utilization: float
    encoder_cache_bytes: int
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
            f"- CUDA graph reserve {self.cuda_graph_reserve_bytes // MIB} MiB; "
            f"{f.free_bytes // MIB} MiB free after the profile run"
        )


def size_kv_cache(
    figures: MemoryFigures,
    *,
    utilization: float,
    bytes_per_block: int,
    encoder_cache_bytes: int,
    cuda_graph_reserve_bytes: int,
) -> KVCacheSizing:
    """The module docstring's rule; ValueError naming what to lower when no block fits."""
    assert 0 < utilization <= 1 and bytes_per_block > 0
    held_bytes = (
        figures.weights_bytes
        + figures.activation_peak_bytes
        + figures.non_torch_bytes
        + encoder_cache_bytes
        + cuda_graph_reserve_bytes
    )
    by_utilization = int(utilization * figures.total_bytes) - held_bytes
    # The weights are already out of the free figure; what runs later must still fit.
    by_free_memory = (
        figures.free_bytes
        - figures.activation_peak_bytes
        - encoder_cache_bytes
        - cuda_graph_reserve_bytes
    )
    kv_bytes = min(by_utilization, by_free_memory)
    num_blocks = max(0, kv_bytes) // bytes_per_block
    sizing = KVCacheSizing(
        figures=figures,
        utilization=utilization,
        encoder_cache_bytes=encoder_cache_bytes,
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
            "--mm-processor-kwargs max_pixels), raise --gpu-memory-utilization, or free the "
            "memory other processes hold on this GPU"
        )
    return sizing


@dataclass(frozen=True)
class GpuProfile:
    """What the profile run needs: the loaded model, its attention, the largest step, and the
    device snapshot taken before the weights were loaded."""

    model: nn.Module
    model_config: ModelConfig
    attention_backend: AttentionBackend
    shape: ProfileShape
    at_start: MemorySnapshot
    device: torch.device
    dtype: torch.dtype


def profiled_kv_budget(
    gpu: GpuProfile,
    memory: DeviceMemory,
    *,
    utilization: float,
    bytes_per_block: int,
    encoder_cache_bytes: int,
    has_cuda_graphs: bool,
) -> int:
    """The profile run (`execution/memory_profile.py`), then `size_kv_cache`; logs the figures."""
    figures = profile_memory(
        gpu.model,
        gpu.model_config,
        gpu.attention_backend,
        gpu.shape,
        memory,
        gpu.at_start,
        device=gpu.device,
        dtype=gpu.dtype,
    )
    logger.info(
        "profile run on %s: ViT on grids %s, LM over %s new tokens and its head on %d rows: "
        "activation peak %d MiB",
        gpu.device,
        list(figures.encoder_grids),
        "+".join(map(str, figures.lm_seq_lens)),
        min(gpu.shape.max_num_seqs, sum(figures.lm_seq_lens)),
        figures.activation_peak_bytes // MIB,
    )
    sizing = size_kv_cache(
        figures,
        utilization=utilization,
        bytes_per_block=bytes_per_block,
        encoder_cache_bytes=encoder_cache_bytes,
        cuda_graph_reserve_bytes=CUDA_GRAPH_RESERVE_BYTES if has_cuda_graphs else 0,
    )
    logger.info("%s", sizing.describe())
    return sizing.kv_cache_bytes
