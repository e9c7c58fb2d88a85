"""The one place that wires an engine together from an EngineConfig."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmserve.config.engine import EngineConfig
from mmserve.config.media import SERVER_DECODE_WORKERS, MediaConfig
from mmserve.config.scheduler import CacheConfig, SchedulerConfig
from mmserve.config.torch_device import resolve_device, resolve_dtype
from mmserve.engine.core.engine_core import CoreLike, EngineCore
from mmserve.engine.frontend.llm_engine import LLMEngine
from mmserve.engine.frontend.output_processor import OutputProcessor
from mmserve.engine.model_source import with_local_sources
from mmserve.engine.remote_encoders import build_encoder_pool, build_url_planner
from mmserve.execution.executor import InProcessExecutor
from mmserve.execution.memory.host_allocator import limit_malloc_arenas
from mmserve.execution.worker import Worker, WorkerConfig
from mmserve.generation_config import load_sampling_defaults
from mmserve.metrics import EngineMetrics
from mmserve.models.config import ModelConfig, load_model_config
from mmserve.processing.image_processor import ImageProcessorConfig
from mmserve.processing.input_processor import InputProcessor
from mmserve.processing.media import MediaLoader
from mmserve.processing.remote_planning import RemoteImagePlanning
from mmserve.processing.tokenizer import Tokenizer
from mmserve.processing.video_inputs import (
    largest_item_tokens,
    load_video_config,
    split_processor_kwargs,
)
from mmserve.scheduling.encoder_cache_manager import EncoderCacheManager
from mmserve.scheduling.kv_cache_manager import KVCacheManager
from mmserve.scheduling.pixel_store import PixelStore
from mmserve.scheduling.scheduler import Scheduler
from mmserve.structured_output.compiler import GrammarCompiler
from mmserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# The engine core decodes only the local fallback's images (no encoder could): one worker,
# started on first use.
FALLBACK_DECODE_WORKERS = 1


@dataclass(frozen=True)
class ResolvedConfig:
    """What the engine actually runs with, after defaults and floors; logged at start-up."""

    model: str
    architecture: str
    device: str
    dtype: str
    max_model_len: int
    num_kv_blocks: int
    kv_cache_bytes: int
    block_size: int
    enable_prefix_caching: bool
    max_num_batched_tokens: int
    max_num_seqs: int
    max_tokens_per_mm_item: int
    max_patches_per_mm_item: int
    encoder_cache_slots: int
    encoder_cache_bytes: int
    encoder_patch_budget: int
    chunked_mm_input: bool
    attention_backend: str
    layer_ops: str  # who computes the decoder's norms, SwiGLU and rotary: torch or triton
    encoder_cuda_graph: bool = False
    cuda_graph_sizes: tuple[int, ...] = ()  # decode batch sizes captured; () when eager

    def __post_init__(self) -> None:
        # from the engine process's ready message a tuple arrives as a list
        object.__setattr__(self, "cuda_graph_sizes", tuple(self.cuda_graph_sizes))

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class EngineShape:
    """What both the API side and the engine core derive from the flags and the checkpoint's
    config files, before any weight is loaded."""

    model_dir: Path
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    image_config: ImageProcessorConfig  # with --mm-processor-kwargs applied
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    scheduler_config: SchedulerConfig


def resolve_shape(config: EngineConfig) -> EngineShape:
    device = resolve_device(config.device.device)
    model_dir = Path(config.checkpoint.model)
    if not (model_dir / "config.json").is_file():
        raise ValueError(
            f"--model {config.checkpoint.model}: no config.json there; is it a model directory?"
        )
    model_config = load_model_config(model_dir)
    dtype = resolve_dtype(config.checkpoint.dtype, device, model_config.dtype)
    max_model_len = config.scheduler.max_model_len or model_config.text.max_position_embeddings
    image_config = ImageProcessorConfig.from_pretrained(model_dir).with_overrides(
        # its video keys: InputProcessor
        split_processor_kwargs(config.multimodal.mm_processor_kwargs)[0]
    )
    tokenizer = Tokenizer.from_pretrained(config.checkpoint.tokenizer or model_dir)
    eos_token_ids = tuple(dict.fromkeys([*tokenizer.stop_token_ids, *model_config.eos_token_ids]))
    # The floors of the encoder budgets: the largest item of every modality the server
    # accepts (what the input processor will let through), so a maximal video fits alone too.
    max_item_tokens = largest_item_tokens(
        image_config,
        load_video_config(model_dir, config.multimodal.mm_processor_kwargs),
        config.multimodal.limit_mm_per_prompt,
        max_model_len,
    )
    merge = model_config.spatial_merge_size
    scheduler_config = dataclasses.replace(
        config.scheduler,
        max_model_len=max_model_len,
        max_tokens_per_mm_item=max_item_tokens,
        max_patches_per_mm_item=max_item_tokens * merge * merge,
        # one embedding in the runner's cache: [hidden] in the model's dtype
        encoder_embed_bytes=model_config.hidden_size * dtype.itemsize,
        patches_per_embed=merge * merge,
    )
    return EngineShape(
        model_dir,
        model_config,
        device,
        dtype,
        max_model_len,
        image_config,
        tokenizer,
        eos_token_ids,
        scheduler_config,
    )


def build_input_processor(
    config: EngineConfig, shape: EngineShape, *, decode_workers: int = 0
) -> InputProcessor:
    """The CPU stage: media fetching and decoding, image processing, templating, tokenizing.

    `decode_workers` > 0 decodes media bytes in that many worker processes, so that a decoder
    crash or hang fails one request instead of the server (the server uses it; the offline API
    decodes in-process).
    """
    media = MediaLoader(_media_config(config.media, shape, decode_workers=decode_workers))
    remote: dict[str, Any] = {}
    if config.encoder_pool.encoder_urls:  # images are planned here and encoded by the pool
        fallback_local = config.encoder_pool.resolved_encoder_fallback == "local"
        remote = {
            "remote_images": RemoteImagePlanning(
                build_url_planner(config.encoder_pool), fallback_local
            )
        }
    return InputProcessor.from_pretrained(
        shape.model_dir,
        max_model_len=shape.max_model_len,
        limit_mm_per_prompt=config.multimodal.limit_mm_per_prompt,
        mm_processor_kwargs=config.multimodal.mm_processor_kwargs,
        mm_processor_cache_gb=config.multimodal.mm_processor_cache_gb,
        hash_algorithm=config.cache.hash_algorithm,
        model_id=config.checkpoint.served_model_name[0]
        if config.checkpoint.served_model_name
        else str(shape.model_dir.resolve()),
        media_loader=media,
        trust_exif_image_id=config.multimodal.trust_exif_image_id,
        tokenizer=shape.tokenizer,
        **remote,
    )


def build_core(
    config: EngineConfig, shape: EngineShape, metrics: EngineMetrics
) -> tuple[EngineCore, ResolvedConfig]:
    """Start the worker and build the scheduler and the executor: what the engine process runs."""
    scheduler_config = shape.scheduler_config
    encoder_source = None
    if config.encoder_pool.encoder_urls:  # images arrive as RemoteItems: the pool encodes them
        encoder_source = build_encoder_pool(
            config.encoder_pool,
            model_dir=shape.model_dir,
            hidden_size=shape.model_config.hidden_size,
            dtype=shape.dtype,
            image_config=shape.image_config,
            media_config=_media_config(config.media, shape, decode_workers=FALLBACK_DECODE_WORKERS),
            metrics=metrics,
        )
    worker = Worker(_worker_config(config, shape), metrics, encoder_source).start()
    cache_config = dataclasses.replace(config.cache, num_blocks=worker.num_blocks)
    scheduler = Scheduler(
        scheduler_config,
        cache_config,
        KVCacheManager(cache_config),
        EncoderCacheManager(
            scheduler_config.effective_encoder_cache_bytes, scheduler_config.encoder_embed_bytes
        ),
        pixel_store=PixelStore(int(config.multimodal.mm_reencode_cache_gb * (1 << 30))),
        eos_token_ids=shape.eos_token_ids,
    )
    _log_encoder_budget(scheduler_config)
    metrics.set_gauge("kv_blocks_total", worker.num_blocks)
    metrics.set_gauge("kv_blocks_free", worker.num_blocks)
    metrics.set_gauge("encoder_cache_total_slots", scheduler_config.effective_encoder_cache_size)
    core = EngineCore(
        scheduler=scheduler,
        executor=InProcessExecutor(worker.runner),
        metrics=metrics,
        max_model_len=shape.max_model_len,
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
        shape.device,
        shape.dtype,
        scheduler_config,
        cache_config,
        worker.bytes_per_block,
        shape.max_model_len,
        worker.attention_backend,
        worker.layer_ops,
    )
    resolved = dataclasses.replace(
        resolved,
        encoder_cuda_graph=worker.encoder_cuda_graph,
        cuda_graph_sizes=worker.cuda_graph_sizes,
    )
    return core, resolved


def _worker_config(config: EngineConfig, shape: EngineShape) -> WorkerConfig:
    sched = shape.scheduler_config
    return WorkerConfig(
        model_dir=shape.model_dir,
        device=shape.device,
        dtype=shape.dtype,
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
        block_size=config.cache.block_size,
        num_gpu_blocks_override=config.cache.num_gpu_blocks_override,
        kv_cache_memory_bytes=config.cache.kv_cache_memory_bytes,
        gpu_memory_utilization=config.device.gpu_memory_utilization,
        enforce_eager=config.device.enforce_eager,
        cuda_graph_sizes=config.device.cuda_graph_sizes,
        enable_encoder_cuda_graph=config.device.enable_encoder_cuda_graph,
    )


def build_engine(
    config: EngineConfig, *, decode_workers: int = 0
) -> tuple[LLMEngine, ResolvedConfig]:
    """An engine with its core in this process, or in an engine process if
    `config.parallel.multiprocess`."""
    config = with_local_sources(config)  # a hub id becomes its snapshot directory, once, here
    shape = resolve_shape(config)
    metrics = EngineMetrics(max_model_len=shape.max_model_len)
    if config.parallel.multiprocess:
        from mmserve.engine.frontend.core_client import CoreClient

        core: CoreLike
        core, resolved = CoreClient.start(config, shape, metrics)
    else:
        core, resolved = build_core(config, shape, metrics)
    tokenizer = shape.tokenizer
    engine = LLMEngine(
        input_processor=build_input_processor(config, shape, decode_workers=decode_workers),
        core=core,
        output_processor=OutputProcessor(
            lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip), metrics
        ),
        metrics=metrics,
        max_model_len=shape.max_model_len,
        max_logprobs=config.checkpoint.max_logprobs,
        sampling_defaults=load_sampling_defaults(
            config.checkpoint.generation_config, shape.model_dir
        ),
    )
    return engine, resolved


def _log_encoder_budget(sched: SchedulerConfig) -> None:
    logger.info(
        "encoder: at most %d input patches per step (largest item %d; --encoder-patch-budget), "
        "cache %d bytes (%.1f MiB = %d embeddings of %d bytes; largest item %d embeddings; "
        "--encoder-cache-bytes or --encoder-cache-size)",
        sched.effective_encoder_patch_budget,
        sched.max_patches_per_mm_item,
        sched.effective_encoder_cache_bytes,
        sched.effective_encoder_cache_bytes / (1 << 20),
        sched.effective_encoder_cache_size,
        sched.encoder_embed_bytes,
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


def build_async_engine(config: EngineConfig):  # -> AsyncLLMEngine
    """The server's engine: its core in an engine process unless `--no-multiprocess`."""
    from mmserve.engine.frontend.async_engine import AsyncLLMEngine

    # Before the serving threads exist (see execution/memory/host_allocator.py). Only the
    # server: it processes pictures on many threads, and the offline API measured ~5% slower
    # with the cap.
    limit_malloc_arenas()
    if config.parallel.multiprocess is None:
        config = dataclasses.replace(
            config, parallel=dataclasses.replace(config.parallel, multiprocess=True)
        )
    engine, resolved = build_engine(config, decode_workers=SERVER_DECODE_WORKERS)
    return AsyncLLMEngine(engine, resolved, model_name=config.checkpoint.resolved_served_model_name)


def _media_config(media: MediaConfig, shape: EngineShape, *, decode_workers: int) -> MediaConfig:
    """The media flags as a loader runs them: the pixel cap resolved against the processor."""
    return media.for_loader(
        processor_max_pixels=shape.image_config.max_pixels, decode_workers=decode_workers
    )
