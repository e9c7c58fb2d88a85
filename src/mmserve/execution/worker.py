"""The worker's start-up as a recipe: load weights -> profile -> size and allocate KV -> capture.

    Worker(config, metrics).start():
        load_model()        attention backend and layer ops picked, weights loaded
        profile()           the largest step once (GPU): the activation peak -> the KV budget
        allocate_kv()       as many blocks as the budget holds (never more than all sequences
                            at full length need), one cache tensor per decoder layer
        compile()           -O1..-O3: the vision blocks and decoder layers compiled and
                            warmed up (compile.py), before any graph captures them
        build_runner()      the encoder (its CUDA graphs if asked), the model runner
        capture_graphs()    decode CUDA graphs (after the KV cache: their replays write it)

The engine core gets back a `StartedWorker`: the runner its executor drives and the figures
the scheduler and the resolved config need.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from mmserve.config.scheduler import CPU_KV_CACHE_BYTES
from mmserve.execution.compile import CompileReport, compile_model, warm_up
from mmserve.execution.encoder.cache import EncoderCache
from mmserve.execution.encoder.graphs import make_encoder_embed
from mmserve.execution.encoder.pixels import ItemDataStore
from mmserve.execution.encoder.runner import EncoderRunner
from mmserve.execution.encoder.source import EncoderSource
from mmserve.execution.graphs.capture import cuda_graph_factory
from mmserve.execution.graphs.decode import (
    CUDA_GRAPH_RESERVE_BYTES,
    GraphMemory,
    graph_sizes_for,
    report_graph_memory,
)
from mmserve.execution.input_batch import input_buffer_bytes
from mmserve.execution.lm_threads import LMThreads, lm_macs_per_token
from mmserve.execution.memory.device import CudaMemory, MemorySnapshot
from mmserve.execution.memory.kv_sizing import GpuProfile, profiled_kv_budget
from mmserve.execution.memory.profile import ProfileShape
from mmserve.execution.model_runner import ModelRunner
from mmserve.host_allocator import tune_host_allocator
from mmserve.layers.attention import AttentionBackend, select_backend
from mmserve.layers.attention.buffers import BatchLimits
from mmserve.layers.fused import LayerOps, TorchLayerOps, select_layer_ops
from mmserve.layers.parallel import SINGLE, TPGroup
from mmserve.metrics import EngineMetrics
from mmserve.models.config import ModelConfig, load_model_config
from mmserve.models.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block
from mmserve.models.loader import load_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    """What the worker's start-up reads: the model, the step's budgets, memory and graphs."""

    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    attention_backend: str  # --attention-backend: auto, torch or triton
    seed: int  # the runner's generator, for rows without a seed of their own
    # the largest step (the scheduler's budgets)
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_tokens_per_mm_item: int
    max_patches_per_call: int  # the encoder's per-step budget, in input patches
    encoder_cache_bytes: int  # what the encoder cache holds when full
    max_logprobs: int
    mm_reencode_cache_bytes: int  # item data kept to encode an item again after a preemption
    # the KV cache: the first of these that is set sizes it (`Worker.profile`)
    block_size: int
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # CUDA graphs
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    enable_encoder_cuda_graph: bool = False
    # torch.compile (-O1..-O3) and where inductor keeps its artefacts; None: eager
    compile_cache_dir: Path | None = None
    # tensor parallelism (--mm-encoder-tp-mode): "data" (a replicated vision tower, the step's
    # items split across the ranks) or "weights" (a sharded one); see execution/encoder/step.py
    mm_encoder_tp_mode: str = "data"

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


class StartedWorker(NamedTuple):
    """What start-up made: the runner and the figures the engine's wiring reports."""

    runner: ModelRunner
    model_config: ModelConfig
    num_blocks: int
    bytes_per_block: int
    attention_backend: str
    layer_ops: str
    encoder_cuda_graph: bool
    cuda_graph_sizes: tuple[int, ...]  # decode batch sizes captured; () when eager
    compiled: CompileReport | None  # -O1..-O3: the start-up compile; None when eager


class Worker:
    """One device's model, KV cache and runner, built in the order of the module docstring.

    `encoder_source` (a disaggregated server's encoder pool) encodes remote items; without one
    a remote item fails its requests. `tp`: this worker's rank in its tensor-parallel group:
    it loads only its shard, and its KV cache (its budget, its blocks) holds only its KV heads.
    """

    def __init__(
        self,
        config: WorkerConfig,
        metrics: EngineMetrics,
        encoder_source: EncoderSource | None = None,
        *,
        tp: TPGroup = SINGLE,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.encoder_source = encoder_source
        self.tp = tp

    def start(self) -> StartedWorker:
        """The recipe."""
        backend, layer_ops, model, model_config, at_start = self.load_model()
        budget_bytes = self.profile(model, model_config, backend, at_start)
        num_blocks, kv_caches = self.allocate_kv(model_config, budget_bytes)
        lm_threads = LMThreads(self.config.device, lm_macs_per_token(model))
        compiled = self.compile(model, kv_caches, backend, lm_threads)
        runner, encoder_cuda_graph = self.build_runner(
            model, model_config, kv_caches, backend, lm_threads
        )
        graph_sizes = self.capture_graphs(runner)
        return StartedWorker(
            runner,
            model_config,
            num_blocks,
            self.bytes_per_block(model_config),
            backend.name,
            layer_ops.name,
            encoder_cuda_graph,
            graph_sizes,
            compiled,
        )

    def load_model(
        self,
    ) -> tuple[AttentionBackend, LayerOps, nn.Module, ModelConfig, MemorySnapshot | None]:
        """The backend and layer ops for the device, then the weights; on a GPU the device
        snapshot taken before them (what the profile's non-torch growth is measured from)."""
        cfg = self.config
        if cfg.device.type == "cpu":
            tune_host_allocator()  # activations live in host memory: reuse it, do not re-fault it
            # NOTE: not torch.set_flush_denormal(True), though denormals slow quick_gelu's
            # sigmoid on x86 (~5% of a CPU step on the benchmark checkpoint): it sets the
            # thread's FTZ/DAZ bits, so every float op of the thread, Python's included, reads
            # a denormal as 0 (a repetition_penalty of 5e-324 became a division by zero).
        # the head dim is checked from config.json, before the weights load
        head_dim = load_model_config(cfg.model_dir).text.head_dim
        backend = select_backend(
            cfg.attention_backend, cfg.device, block_size=cfg.block_size, head_dim=head_dim
        )
        # Compiled (-O1..-O3), the layers keep torch's ops and inductor fuses them itself; the
        # hand-written Triton ops are for eager layers (compile.py).
        compiles = cfg.compile_cache_dir is not None
        layer_ops = TorchLayerOps() if compiles else select_layer_ops(backend.name)
        at_start = CudaMemory(cfg.device).snapshot() if cfg.device.type == "cuda" else None
        logger.info(
            "attention backend: %s (--attention-backend %s, device %s); norms, SwiGLU, rotary: %s",
            backend.name,
            cfg.attention_backend,
            cfg.device,
            layer_ops.name,
        )
        model, model_config = load_model(
            cfg.model_dir,
            device=cfg.device,
            dtype=cfg.dtype,
            layer_ops=layer_ops,
            tp=self.tp,
            # --mm-encoder-tp-mode weights: the tower sharded too (data: replicated)
            shard_vision=self.tp.size > 1 and cfg.mm_encoder_tp_mode == "weights",
        )
        return backend, layer_ops, model, model_config, at_start

    def profile(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        backend: AttentionBackend,
        at_start: MemorySnapshot | None,
    ) -> int | None:
        """The KV cache's budget in bytes: a flag's, the profile run's on a GPU, else the CPU
        default (logged); None when `--num-gpu-blocks-override` gives the block count."""
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            return None
        if cfg.kv_cache_memory_bytes is not None:
            return cfg.kv_cache_memory_bytes
        if at_start is None:
            logger.info(
                "KV cache on the CPU: %d MiB (--kv-cache-memory-bytes sizes it; "
                "--gpu-memory-utilization applies to CUDA devices only)",
                CPU_KV_CACHE_BYTES >> 20,
            )
            return CPU_KV_CACHE_BYTES
        shape = ProfileShape(
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=cfg.max_model_len,
            max_patches_per_call=cfg.max_patches_per_call,
            max_tokens_per_mm_item=cfg.max_tokens_per_mm_item,
            block_size=cfg.block_size,
            max_logprobs=cfg.max_logprobs,
        )
        limits = self.batch_limits()
        return profiled_kv_budget(
            GpuProfile(
                model, model_config, backend, shape, at_start, cfg.device, cfg.dtype, self.tp
            ),
            CudaMemory(cfg.device),
            utilization=cfg.gpu_memory_utilization,
            bytes_per_block=self.bytes_per_block(model_config),
            encoder_cache_bytes=cfg.encoder_cache_bytes,
            input_buffer_bytes=input_buffer_bytes(limits),
            # decode graphs are captured with a capturable backend only (`graph_sizes_for`)
            has_cuda_graphs=not cfg.enforce_eager and backend.supports_capture,
            has_encoder_cuda_graphs=cfg.enable_encoder_cuda_graph and not cfg.enforce_eager,
        )

    def allocate_kv(
        self, model_config: ModelConfig, budget_bytes: int | None
    ) -> tuple[int, list[torch.Tensor]]:
        """The number of blocks and the zeroed caches, one per decoder layer."""
        cfg = self.config
        num_blocks = self.num_kv_blocks(model_config, budget_bytes)
        caches = allocate_kv_caches(
            model_config, num_blocks, cfg.block_size, cfg.device, cfg.dtype, self.tp
        )
        return num_blocks, caches

    def num_kv_blocks(self, model_config: ModelConfig, budget_bytes: int | None) -> int:
        """`--num-gpu-blocks-override` (no budget), else what the budget holds, never more
        than every sequence at full length needs; ValueError when no block fits."""
        cfg = self.config
        if budget_bytes is None:
            assert cfg.num_gpu_blocks_override is not None
            return cfg.num_gpu_blocks_override
        bytes_per_block = self.bytes_per_block(model_config)
        blocks_needed = cfg.max_num_seqs * cfg.max_blocks_per_seq
        num_blocks = min(budget_bytes // bytes_per_block, blocks_needed)
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget_bytes} bytes) holds no block of "
                f"{bytes_per_block} bytes; raise --kv-cache-memory-bytes"
            )
        return int(num_blocks)

    def compile(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        lm_threads: LMThreads,
    ) -> CompileReport | None:
        """-O1..-O3: compile the blocks and layers and run each graph once (compile.py)."""
        cfg = self.config
        if cfg.compile_cache_dir is None:
            return None
        compile_model(model, cfg.compile_cache_dir)
        return warm_up(
            model,
            kv_caches,
            backend,
            block_size=cfg.block_size,
            device=cfg.device,
            cache_dir=cfg.compile_cache_dir,
            lm_threads=lm_threads,
            max_num_tokens=cfg.max_num_batched_tokens,
        )

    def build_runner(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        lm_threads: LMThreads,
    ) -> tuple[ModelRunner, bool]:
        """The runner over the model and its caches; whether the encoder replays graphs."""
        cfg = self.config
        embed, encoder_cuda_graph = make_encoder_embed(
            model,
            enable_encoder_cuda_graph=cfg.enable_encoder_cuda_graph,
            enforce_eager=cfg.enforce_eager,
            device=cfg.device,
            dtype=cfg.dtype,
            max_patches_per_call=cfg.max_patches_per_call,
        )
        encoder = EncoderRunner(
            embed,
            EncoderCache(cfg.device, cfg.dtype),
            max_patches_per_call=cfg.max_patches_per_call,
            metrics=self.metrics,
        )
        runner = ModelRunner(
            model,
            kv_caches,
            encoder,
            block_size=cfg.block_size,
            placeholder_token_ids=(model_config.image_token_id, model_config.video_token_id),
            device=cfg.device,
            seed=cfg.seed,
            attention_backend=backend,
            limits=self.batch_limits(),
            encoder_source=self.encoder_source,
            item_data=ItemDataStore(cfg.mm_reencode_cache_bytes),
            tp=self.tp,
            mm_encoder_tp_mode=cfg.mm_encoder_tp_mode,
            lm_threads=lm_threads,
        )
        return runner, encoder_cuda_graph

    def capture_graphs(self, runner: ModelRunner) -> tuple[int, ...]:
        """Capture the runner's decode graphs as the flags say; the sizes captured."""
        cfg = self.config
        sizes = graph_sizes_for(
            enforce_eager=cfg.enforce_eager,
            device=cfg.device,
            backend=runner.attention_backend,
            max_num_seqs=cfg.max_num_seqs,
            requested=cfg.cuda_graph_sizes,
        )
        if not sizes:
            return ()
        memory = CudaMemory(cfg.device)
        memory.synchronize()
        before = memory.snapshot()
        seconds = runner.capture_decode_graphs(sizes, cuda_graph_factory())
        memory.synchronize()
        after = memory.snapshot()
        logger.info(
            "decode CUDA graphs: captured %d batch sizes %s in %.2f s (--enforce-eager turns "
            "them off, --cuda-graph-sizes picks the sizes)",
            len(sizes),
            list(sizes),
            seconds,
        )
        report_graph_memory(
            GraphMemory(
                pool_bytes=after.reserved_bytes - before.reserved_bytes,
                device_bytes=before.free_bytes - after.free_bytes,
            ),
            CUDA_GRAPH_RESERVE_BYTES,
        )
        return sizes

    def batch_limits(self) -> BatchLimits:
        """The largest step the runner's persistent input buffers hold."""
        cfg = self.config
        return BatchLimits(
            max_num_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs,
            max_blocks_per_seq=cfg.max_blocks_per_seq,
        )

    def bytes_per_block(self, model_config: ModelConfig) -> int:
        """What one KV block costs this rank (its KV heads only)."""
        cfg = self.config
        return kv_cache_bytes_per_block(model_config, cfg.block_size, cfg.dtype, self.tp)
