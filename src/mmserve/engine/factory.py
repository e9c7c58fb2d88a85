"""The one place that wires an engine together from EngineArgs."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.engine.args import EngineArgs
from mmserve.engine.core import CoreLike, EngineCore
from mmserve.engine.host_allocator import limit_malloc_arenas, tune_host_allocator
from mmserve.engine.llm_engine import LLMEngine
from mmserve.engine.model_source import with_local_sources
from mmserve.engine.output_processor import OutputProcessor
from mmserve.execution.encoder_runner import EncoderRunner
from mmserve.execution.executor import InProcessExecutor
from mmserve.execution.model_runner import ModelRunner
from mmserve.generation_config import load_sampling_defaults
from mmserve.layers.attention import (
    allocate_kv_caches,
    kv_cache_bytes_per_block,
    select_backend,
)
from mmserve.metrics import EngineMetrics
from mmserve.models.config import ModelConfig, load_model_config
from mmserve.models.loader import load_model
from mmserve.processing.image_decode import default_max_image_pixels
from mmserve.processing.image_processor import ImageProcessorConfig, max_tokens_per_item
from mmserve.processing.input_processor import InputProcessor
from mmserve.processing.media import MediaConfig, MediaLoader
from mmserve.processing.tokenizer import Tokenizer
from mmserve.processing.video_inputs import split_processor_kwargs
from mmserve.scheduling.scheduler import Scheduler
from mmserve.structured_output.compiler import GrammarCompiler
from mmserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 2 << 30  # default KV pool on the CPU when nothing sizes it
SERVER_DECODE_WORKERS = 2


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
    encoder_cache_slots: int
    encoder_cache_bytes: int
    encoder_compute_budget: int
    chunked_mm_input: bool
    attention_backend: str

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in half precision are slow and less accurate
    ckpt = getattr(torch, checkpoint_dtype, torch.bfloat16)
    return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16


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


def resolve_shape(args: EngineArgs) -> EngineShape:
    device = resolve_device(args.device)
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"--model {args.model}: no config.json there; is it a model directory?")
    model_config = load_model_config(model_dir)
    dtype = resolve_dtype(args.dtype, device, model_config.dtype)
    max_model_len = args.max_model_len or model_config.text.max_position_embeddings
    image_config = ImageProcessorConfig.from_pretrained(model_dir).with_overrides(
        split_processor_kwargs(args.mm_processor_kwargs)[0]  # its video keys: InputProcessor
    )
    tokenizer = Tokenizer.from_pretrained(args.tokenizer or model_dir)
    eos_token_ids = tuple(dict.fromkeys([*tokenizer.stop_token_ids, *model_config.eos_token_ids]))
    scheduler_config = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_tokens_per_mm_item=max_tokens_per_item(image_config),
        disable_chunked_mm_input=args.disable_chunked_mm_input,
        encoder_cache_size=args.encoder_cache_size,
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
    args: EngineArgs, shape: EngineShape, *, decode_workers: int = 0
) -> InputProcessor:
    """The CPU stage: media fetching and decoding, image processing, templating, tokenizing.

    `decode_workers` > 0 decodes media bytes in that many worker processes, so that a decoder
    crash or hang fails one request instead of the server (the server uses it; the offline API
    decodes in-process).
    """
    # No image needs more pixels than the processor resizes it to (or 4096x4096 when that is less).
    max_image_pixels = args.max_image_pixels or default_max_image_pixels(
        shape.image_config.max_pixels
    )
    media = MediaLoader(
        MediaConfig(
            allowed_media_domains=args.allowed_media_domains or (),
            allowed_local_media_path=args.allowed_local_media_path,
            fetch_timeout_s=args.media_fetch_timeout,
            max_fetch_bytes=args.max_media_bytes,
            max_concurrent_fetches=args.max_concurrent_media_fetches,
            decode_workers=decode_workers,
            max_image_pixels=max_image_pixels,
            max_decode_bytes_per_request=args.max_decode_bytes_per_request,
            max_inflight_decode_bytes=args.max_inflight_decode_bytes,
            decode_wait_timeout_s=args.decode_wait_timeout,
            decode_worker_max_rss_bytes=args.decode_worker_max_rss_mb << 20,
            max_video_bytes=args.max_video_bytes,
            max_video_seconds=args.max_video_seconds,
            max_video_frames_decoded=args.max_video_frames_decoded,
            max_video_frame_pixels=args.max_video_frame_pixels,
            max_video_decoded_pixels=args.max_video_decoded_pixels,
            video_decode_timeout_s=args.video_decode_timeout,
        )
    )
    return InputProcessor.from_pretrained(
        shape.model_dir,
        max_model_len=shape.max_model_len,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        mm_processor_kwargs=args.mm_processor_kwargs,
        mm_processor_cache_gb=args.mm_processor_cache_gb,
        hash_algorithm=args.hash_algorithm,
        model_id=args.served_model_name[0]
        if args.served_model_name
        else str(shape.model_dir.resolve()),
        media_loader=media,
        trust_exif_image_id=args.trust_exif_image_id,
        tokenizer=shape.tokenizer,
    )


def build_core(
    args: EngineArgs, shape: EngineShape, metrics: EngineMetrics
) -> tuple[EngineCore, ResolvedConfig]:
    """Load the weights and build the scheduler and the executor: what the engine process runs."""
    torch.manual_seed(args.seed)
    device, dtype = shape.device, shape.dtype
    if device.type == "cpu":
        tune_host_allocator()  # activations live in host memory: reuse it, do not re-fault it
    attention_backend = select_backend(args.attention_backend, device, block_size=args.block_size)
    logger.info(
        "attention backend: %s (--attention-backend %s, device %s)",
        attention_backend.name,
        args.attention_backend,
        device,
    )
    model, model_config = load_model(shape.model_dir, device=device, dtype=dtype)
    scheduler_config = shape.scheduler_config
    bytes_per_block = kv_cache_bytes_per_block(model_config, args.block_size, dtype)
    num_blocks = _num_kv_blocks(args, scheduler_config, bytes_per_block, device)
    cache_config = CacheConfig(
        num_blocks=num_blocks,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        hash_algorithm=args.hash_algorithm,
    )
    element_bytes = torch.empty((), dtype=dtype).element_size()
    bytes_per_slot = model_config.hidden_size * element_bytes
    scheduler = Scheduler(
        scheduler_config,
        cache_config,
        bytes_per_encoder_slot=bytes_per_slot,
        eos_token_ids=shape.eos_token_ids,
        pixel_store_bytes=int(args.mm_reencode_cache_gb * (1 << 30)),
    )
    merge = model_config.spatial_merge_size
    encoder = EncoderRunner(
        model.embed_multimodal,
        device=device,
        dtype=dtype,
        # the per-step encoder budget, in input patches (what activation memory scales with)
        max_patches_per_call=scheduler_config.effective_encoder_compute_budget * merge * merge,
        metrics=metrics,
    )
    runner = ModelRunner(
        model,
        allocate_kv_caches(model_config, num_blocks, args.block_size, device, dtype),
        encoder,
        block_size=args.block_size,
        placeholder_token_ids=(model_config.image_token_id, model_config.video_token_id),
        device=device,
        seed=args.seed,
        attention_backend=attention_backend,
    )
    metrics.set_gauge("kv_blocks_total", num_blocks)
    metrics.set_gauge("kv_blocks_free", num_blocks)
    metrics.set_gauge("encoder_cache_total_slots", scheduler_config.effective_encoder_cache_size)
    core = EngineCore(
        scheduler=scheduler,
        executor=InProcessExecutor(runner),
        metrics=metrics,
        max_model_len=shape.max_model_len,
        eos_token_ids=shape.eos_token_ids,
        structured_output=StructuredOutputManager(
            lambda: GrammarCompiler.from_tokenizer_file(
                shape.model_dir / "tokenizer.json",
                vocab_size=model_config.vocab_size,
                eos_token_ids=shape.eos_token_ids,
            )
        ),
    )
    resolved = _describe(
        args,
        model_config,
        device,
        dtype,
        scheduler_config,
        cache_config,
        bytes_per_block,
        bytes_per_slot,
        shape.max_model_len,
        attention_backend.name,
    )
    return core, resolved


def build_engine(args: EngineArgs, *, decode_workers: int = 0) -> tuple[LLMEngine, ResolvedConfig]:
    """An engine with its core in this process, or in an engine process if `args.multiprocess`."""
    args = with_local_sources(args)  # a hub id becomes its snapshot directory, once, here
    shape = resolve_shape(args)
    metrics = EngineMetrics(max_model_len=shape.max_model_len)
    if args.multiprocess:
        from mmserve.engine.core_client import CoreClient

        core: CoreLike
        core, resolved = CoreClient.start(args, shape, metrics)
    else:
        core, resolved = build_core(args, shape, metrics)
    tokenizer = shape.tokenizer
    engine = LLMEngine(
        input_processor=build_input_processor(args, shape, decode_workers=decode_workers),
        core=core,
        output_processor=OutputProcessor(
            lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip), metrics
        ),
        metrics=metrics,
        max_model_len=shape.max_model_len,
        max_logprobs=args.max_logprobs,
        sampling_defaults=load_sampling_defaults(args.generation_config, shape.model_dir),
    )
    return engine, resolved


def _num_kv_blocks(
    args: EngineArgs, sched: SchedulerConfig, bytes_per_block: int, device: torch.device
) -> int:
    if args.num_gpu_blocks_override is not None:
        return args.num_gpu_blocks_override
    if args.kv_cache_memory_bytes is not None:
        budget = args.kv_cache_memory_bytes
    elif device.type == "cuda":
        budget = _gpu_kv_budget(args.gpu_memory_utilization, device)
    else:
        budget = CPU_KV_CACHE_BYTES
        logger.info(
            "KV cache on the CPU: %d MiB (--kv-cache-memory-bytes sizes it; "
            "--gpu-memory-utilization applies to CUDA devices only)",
            budget >> 20,
        )
    # never more than every sequence at full length needs
    blocks_needed = sched.max_num_seqs * -(-sched.max_model_len // args.block_size)
    num_blocks = min(budget // bytes_per_block, blocks_needed)
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) holds no block of {bytes_per_block} bytes; "
            "raise --kv-cache-memory-bytes"
        )
    return int(num_blocks)


def _gpu_kv_budget(utilization: float, device: torch.device) -> int:
    """vLLM's rule, without its profile run yet: this process may use `utilization` of the
    GPU's memory; what it already holds (the weights) is taken off, never more than is free now
    (another process may hold some), and a tenth of the rest stays free for activations."""
    free, total = torch.cuda.mem_get_info(device)
    in_use = torch.cuda.memory_reserved(device)
    usable = max(0, min(int(utilization * total) - in_use, free))
    budget = int(usable * 0.9)
    logger.info(
        "KV cache on %s: %d MiB = 90%% of min(%.2f x %d MiB total - %d MiB this process holds, "
        "%d MiB free)",
        device,
        budget >> 20,
        utilization,
        total >> 20,
        in_use >> 20,
        free >> 20,
    )
    return budget


def _describe(
    args: EngineArgs,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    sched: SchedulerConfig,
    cache: CacheConfig,
    bytes_per_block: int,
    bytes_per_slot: int,
    max_model_len: int,
    attention_backend: str,
) -> ResolvedConfig:
    return ResolvedConfig(
        model=str(args.model),
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
        encoder_cache_slots=sched.effective_encoder_cache_size,
        encoder_cache_bytes=sched.effective_encoder_cache_size * bytes_per_slot,
        encoder_compute_budget=sched.effective_encoder_compute_budget,
        chunked_mm_input=not sched.disable_chunked_mm_input,
        attention_backend=attention_backend,
    )


def build_async_engine(args: EngineArgs):  # -> AsyncLLMEngine
    """The server's engine: its core in an engine process unless `--no-multiprocess`."""
    from mmserve.engine.async_engine import AsyncLLMEngine

    # Before the serving threads exist (see host_allocator.py). Only the server: it processes
    # pictures on many threads, and the offline API measured ~5% slower with the cap.
    limit_malloc_arenas()
    if args.multiprocess is None:
        args = dataclasses.replace(args, multiprocess=True)
    engine, resolved = build_engine(args, decode_workers=SERVER_DECODE_WORKERS)
    return AsyncLLMEngine(engine, resolved, model_name=args.resolved_served_model_name)
