"""The engine process's side of start-up: device and dtype, the worker, the scheduler, the core.

Everything here runs where the model runs (the engine process, or the API process with
`--no-multiprocess` and the offline `LLM`); the API side reaches it only through
`engine.factory`'s in-process branch or the engine process's entry point.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import msgspec
import torch

from mmserve.config.engine import EngineConfig
from mmserve.config.parallel import ParallelConfig
from mmserve.config.resolved import ResolvedConfig
from mmserve.config.scheduler import CacheConfig, SchedulerConfig
from mmserve.config.torch_device import resolve_device, resolve_dtype
from mmserve.engine.core.encoder_pool import build_encoder_pool
from mmserve.engine.core.engine_core import EngineCore
from mmserve.engine.shape import EngineShape, loader_media_config
from mmserve.execution.compile import CompileReport
from mmserve.execution.executor import Executor, InProcessExecutor
from mmserve.execution.parallel.start import start_executor
from mmserve.execution.worker import StartedWorker, Worker, WorkerConfig
from mmserve.metrics import EngineMetrics
from mmserve.models.config import ModelConfig
from mmserve.scheduling.encoder_cache_manager import EncoderCacheManager
from mmserve.scheduling.item_data import ItemDataHolder
from mmserve.scheduling.kv_cache_manager import KVCacheManager
from mmserve.scheduling.scheduler import Scheduler
from mmserve.structured_output.compiler import GrammarCompiler
from mmserve.structured_output.manager import StructuredOutputManager
from mmserve.wire.executor import WorkerReady

logger = logging.getLogger(__name__)

# The engine core decodes only the local fallback's images (no encoder could): one worker,
# started on first use.
FALLBACK_DECODE_WORKERS = 1


def build_core(
    config: EngineConfig, shape: EngineShape, metrics: EngineMetrics
) -> tuple[EngineCore, ResolvedConfig]:
    """Start the worker(s) and build the scheduler and the executor: what the engine process
    runs."""
    device = resolve_device(config.device.device)
    if config.device.cpu_threads is not None:  # in the engine process or the caller's own
        torch.set_num_threads(config.device.cpu_threads)
    dtype = resolve_dtype(config.checkpoint.dtype, device, shape.model_config.dtype)
    scheduler_config = core_scheduler_config(shape, dtype)
    if config.parallel.tensor_parallel_size > 1:
        worker, executor, item_data = _start_ranks(config, shape, metrics, device, dtype)
    else:
        worker, executor, item_data = _start_in_process(config, shape, metrics, device, dtype)
    try:
        return _build_around(config, shape, metrics, scheduler_config, worker, executor, item_data)
    except BaseException:
        executor.shutdown()  # rank processes (or the runner's encoder source) go with it
        raise


def _build_around(
    config: EngineConfig,
    shape: EngineShape,
    metrics: EngineMetrics,
    scheduler_config: SchedulerConfig,
    worker: StartedWorker,
    executor: Executor,
    item_data: ItemDataHolder,
) -> tuple[EngineCore, ResolvedConfig]:
    """The scheduler and the core around a started worker (or ranks)."""
    device = resolve_device(config.device.device)
    dtype = resolve_dtype(config.checkpoint.dtype, device, shape.model_config.dtype)
    cache_config = dataclasses.replace(config.cache, num_blocks=worker.num_blocks)
    scheduler = Scheduler(
        scheduler_config,
        cache_config,
        KVCacheManager(cache_config),
        EncoderCacheManager(
            scheduler_config.effective_encoder_cache_bytes, scheduler_config.encoder_embed_bytes
        ),
        item_data=item_data,
        eos_token_ids=shape.eos_token_ids,
    )
    _log_encoder_budget(scheduler_config, shape.model_config)
    metrics.set_gauge("kv_blocks_total", worker.num_blocks)
    metrics.set_gauge("kv_blocks_free", worker.num_blocks)
    metrics.set_gauge("encoder_cache_total_slots", scheduler_config.effective_encoder_cache_size)
    core = EngineCore(
        scheduler=scheduler,
        executor=executor,
        metrics=metrics,
        eos_token_ids=shape.eos_token_ids,
        structured_output=StructuredOutputManager(
            lambda: GrammarCompiler.from_tokenizer_file(
                shape.model_dir / "tokenizer.json",
                vocab_size=worker.model_config.vocab_size,
                eos_token_ids=shape.eos_token_ids,
            )
        ),
    )
    resolved = _describe(
        config,
        worker.model_config,
        device,
        dtype,
        scheduler_config,
        cache_config,
        worker.bytes_per_block,
        shape.max_model_len,
        worker.attention_backend,
        worker.layer_ops,
    )
    resolved = msgspec.structs.replace(
        resolved,
        encoder_cuda_graph=worker.encoder_cuda_graph,
        cuda_graph_sizes=worker.cuda_graph_sizes,
        compiled=worker.compiled is not None,
    )
    return core, resolved


def core_scheduler_config(shape: EngineShape, dtype: torch.dtype) -> SchedulerConfig:
    """The scheduler's config with the encoder cache's bytes, which are the engine's to size
    (the API side admits by what the core reports)."""
    return dataclasses.replace(
        shape.scheduler_config,
        encoder_embed_bytes=encoder_embed_bytes(shape.model_config, dtype),
    )


def worker_config(
    config: EngineConfig, shape: EngineShape, device: torch.device, dtype: torch.dtype
) -> WorkerConfig:
    """What each worker starts from: the same on every rank of every node (a --headless node
    computes it from the same flags)."""
    return _worker_config(config, shape, core_scheduler_config(shape, dtype), device, dtype)


def _start_in_process(
    config: EngineConfig,
    shape: EngineShape,
    metrics: EngineMetrics,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[StartedWorker, Executor, ItemDataHolder]:
    encoder_source = None
    if config.encoder_pool.encoder_urls:  # images arrive as RemoteItems: the pool encodes them
        encoder_source = build_encoder_pool(
            config.encoder_pool,
            model_dir=shape.model_dir,
            embedding_width=shape.model_config.mm_embedding_width,
            dtype=dtype,
            image_config=shape.image_config,
            media_config=loader_media_config(
                config.media, shape, decode_workers=FALLBACK_DECODE_WORKERS
            ),
            metrics=metrics,
        )
    worker_cfg = worker_config(config, shape, device, dtype)
    worker = Worker(worker_cfg, metrics, encoder_source).start()
    return worker, InProcessExecutor(worker.runner), worker.runner.item_data


def _start_ranks(
    config: EngineConfig,
    shape: EngineShape,
    metrics: EngineMetrics,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[StartedWorker, Executor, ItemDataHolder]:
    """--tensor-parallel-size > 1: this node's ranks as processes (and the other nodes'
    joining), driven by a MultiprocExecutor; the figures are the ranks' (KV blocks: the
    fewest any rank holds)."""
    parallel = config.parallel
    if config.encoder_pool.encoder_urls:
        raise ValueError(
            "--encoder-urls with --tensor-parallel-size > 1 is not supported yet: the remote "
            "encoder pool feeds one in-process worker; drop one of the two"
        )
    executor, ready = start_executor(
        worker_config(config, shape, device, dtype),
        parallel,
        metrics,
        _log_level(),
        cpu_threads=config.device.cpu_threads,
    )
    try:
        worker = _started_ranks(ready, shape, parallel)
    except BaseException:
        executor.shutdown()
        raise
    return worker, executor, executor.item_data


def _started_ranks(
    ready: list[WorkerReady], shape: EngineShape, parallel: ParallelConfig
) -> StartedWorker:
    """The ranks' start-up as one worker's figures (no runner in this process)."""
    first = ready[0]
    compiled = None
    if first.compile_seconds is not None:
        cache_dir = Path(first.compile_cache_dir)
        compiled = CompileReport(first.compile_seconds, first.compile_num_graphs, cache_dir)
    worker = StartedWorker(
        None,
        shape.model_config,
        min(r.num_blocks for r in ready),
        first.bytes_per_block,
        first.attention_backend,
        first.layer_ops,
        first.encoder_cuda_graph,
        first.cuda_graph_sizes,
        compiled,
    )
    logger.info(
        "tensor parallel: %d ranks over %d node(s), vision tower --mm-encoder-tp-mode %s; "
        "KV blocks per rank %s",
        parallel.tensor_parallel_size,
        parallel.nnodes,
        parallel.mm_encoder_tp_mode,
        [r.num_blocks for r in ready],
    )
    return worker


def _log_level() -> str:
    """The ranks log at this process's level (INFO when logging is not configured)."""
    root = logging.getLogger()
    return logging.getLevelName(root.level) if root.handlers else "INFO"


def encoder_embed_bytes(model_config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one embedding slot of the encoder cache: one row of an item's encoder output,
    [mm_embedding_width] = the main embedding and every DeepStack level, in the model's dtype.
    Every byte count of the encoder cache (its size, admission, the ledger, the metrics)
    multiplies this."""
    return model_config.mm_embedding_width * dtype.itemsize


def _worker_config(
    config: EngineConfig,
    shape: EngineShape,
    sched: SchedulerConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> WorkerConfig:
    return WorkerConfig(
        model_dir=shape.model_dir,
        device=device,
        dtype=dtype,
        attention_backend=config.device.attention_backend,
        seed=config.checkpoint.seed,
        max_model_len=shape.max_model_len,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs,
        max_tokens_per_mm_item=sched.max_tokens_per_mm_item,
        # the per-step encoder budget, in input patches (what activation memory scales with)
        max_patches_per_call=sched.effective_encoder_patch_budget,
        encoder_cache_bytes=sched.effective_encoder_cache_bytes,
        max_logprobs=config.checkpoint.max_logprobs,
        mm_reencode_cache_bytes=int(config.multimodal.mm_reencode_cache_gb * (1 << 30)),
        block_size=config.cache.block_size,
        num_gpu_blocks_override=config.cache.num_gpu_blocks_override,
        kv_cache_memory_bytes=config.cache.kv_cache_memory_bytes,
        gpu_memory_utilization=config.device.gpu_memory_utilization,
        enforce_eager=config.device.runs_eager,
        cuda_graph_sizes=config.device.cuda_graph_sizes,
        enable_encoder_cuda_graph=config.device.enable_encoder_cuda_graph,
        compile_cache_dir=(
            Path(config.device.compile_cache_dir).expanduser()
            if config.device.compiles_model
            else None
        ),
        mm_encoder_tp_mode=config.parallel.mm_encoder_tp_mode,
    )


def _log_encoder_budget(sched: SchedulerConfig, model_config: ModelConfig) -> None:
    logger.info(
        "encoder: at most %d input patches per step (largest item %d; --encoder-patch-budget), "
        "cache %d bytes (%.1f MiB = %d embeddings of %d bytes: hidden %d x (1 + %d DeepStack "
        "levels); largest item %d embeddings; --encoder-cache-bytes or --encoder-cache-size)",
        sched.effective_encoder_patch_budget,
        sched.max_patches_per_mm_item,
        sched.effective_encoder_cache_bytes,
        sched.effective_encoder_cache_bytes / (1 << 20),
        sched.effective_encoder_cache_size,
        sched.encoder_embed_bytes,
        model_config.hidden_size,
        model_config.deepstack_levels,
        sched.max_tokens_per_mm_item,
    )


def _describe(
    config: EngineConfig,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    sched: SchedulerConfig,
    cache: CacheConfig,
    bytes_per_block: int,
    max_model_len: int,
    attention_backend: str,
    layer_ops: str,
) -> ResolvedConfig:
    return ResolvedConfig(
        model=str(config.checkpoint.model),
        architecture=model_config.architecture,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=max_model_len,
        num_kv_blocks=cache.num_blocks,
        kv_cache_bytes=cache.num_blocks * bytes_per_block,
        block_size=cache.block_size,
        enable_prefix_caching=cache.enable_prefix_caching,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs,
        max_tokens_per_mm_item=sched.max_tokens_per_mm_item,
        max_patches_per_mm_item=sched.max_patches_per_mm_item,
        encoder_cache_slots=sched.effective_encoder_cache_size,
        encoder_cache_bytes=sched.effective_encoder_cache_bytes,
        encoder_patch_budget=sched.effective_encoder_patch_budget,
        chunked_mm_input=not sched.disable_chunked_mm_input,
        attention_backend=attention_backend,
        layer_ops=layer_ops,
    )
