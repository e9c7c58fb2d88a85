"""The one place that wires an engine together from an EngineConfig.

The API side (input processor, output processor, `LLMEngine`) is built here; the core is an
engine process (`CoreClient`), several (`ReplicaSet`, with --data-parallel-size > 1) or,
in-process, what `engine.core.build` makes, imported only on that path so that an API process
with its core apart never imports torch.
"""

from __future__ import annotations

import logging
from typing import Any

from mmserve.config.engine import EngineConfig
from mmserve.config.resolved import ResolvedConfig
from mmserve.engine.frontend.core_client import CoreClient
from mmserve.engine.frontend.llm_engine import LLMEngine
from mmserve.engine.frontend.output_processor import OutputProcessor
from mmserve.engine.frontend.protocol import CoreLike
from mmserve.engine.frontend.replicas import ReplicaSet
from mmserve.engine.model_source import with_local_sources
from mmserve.engine.remote_encoders import build_url_planner
from mmserve.engine.shape import EngineShape, loader_media_config, resolve_shape
from mmserve.generation_config import load_sampling_defaults
from mmserve.metrics import EngineMetrics
from mmserve.processing.input_processor import InputProcessor
from mmserve.processing.media import MediaLoader
from mmserve.processing.remote_planning import RemoteImagePlanning

logger = logging.getLogger(__name__)


def build_engine(
    config: EngineConfig, *, decode_workers: int = 0
) -> tuple[LLMEngine, ResolvedConfig]:
    """An engine with its core in this process, or in an engine process if
    `config.parallel.multiprocess`, or in `data_parallel_size` engine processes (replicas)."""
    config = with_local_sources(config)  # a hub id becomes its snapshot directory, once, here
    shape = resolve_shape(config)
    metrics = EngineMetrics(max_model_len=shape.max_model_len)
    # Before the core: its start-up (seconds) covers the decode workers' (a server's).
    input_processor = build_input_processor(config, shape, decode_workers=decode_workers)
    input_processor.media_loader.start_decode_workers()
    try:
        core, resolved = _start_core(config, shape, metrics)
    except BaseException:
        input_processor.media_loader.close()  # its decode workers too
        raise
    tokenizer = shape.tokenizer
    engine = LLMEngine(
        input_processor=input_processor,
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


def _start_core(
    config: EngineConfig, shape: EngineShape, metrics: EngineMetrics
) -> tuple[CoreLike, ResolvedConfig]:
    if config.parallel.data_parallel_size > 1:
        # each replica's stats land in its own metrics, which `metrics.replicas` sums
        return ReplicaSet.start(config, metrics, shape.max_model_len)
    if config.parallel.uses_engine_processes:
        return CoreClient.start(config, metrics)
    # The model runs in this process: only here does the API side import the core (torch).
    from mmserve.engine.core.build import build_core

    return build_core(config, shape, metrics)


def build_input_processor(
    config: EngineConfig, shape: EngineShape, *, decode_workers: int = 0
) -> InputProcessor:
    """The CPU stage: media fetching and decoding, image processing, templating, tokenizing.

    `decode_workers` > 0 decodes media bytes in that many worker processes, so that a decoder
    crash or hang fails one request instead of the server (the server uses it; the offline API
    decodes in-process).
    """
    media = MediaLoader(loader_media_config(config.media, shape, decode_workers=decode_workers))
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
