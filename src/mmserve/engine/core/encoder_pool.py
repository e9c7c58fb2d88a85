"""The engine core's client of the encoder pool (`--encoder-urls`): its runner's EncoderSource."""

from __future__ import annotations

from pathlib import Path

import torch

from mmserve.config.media import MediaConfig
from mmserve.config.pool import EncoderPoolConfig
from mmserve.disaggregation.discovery import ModelIdentity
from mmserve.disaggregation.local_fallback import LocalFallback
from mmserve.disaggregation.pool import PoolConfig, RemoteEncoderPool
from mmserve.disaggregation.protocol import model_fingerprint
from mmserve.engine.remote_encoders import read_encoder_secret
from mmserve.metrics import EngineMetrics
from mmserve.processing.image_processor import ImageProcessorConfig
from mmserve.processing.media import MediaLoader


def build_encoder_pool(
    pool: EncoderPoolConfig,
    *,
    model_dir: Path,
    embedding_width: int,
    dtype: torch.dtype,
    image_config: ImageProcessorConfig,
    media_config: MediaConfig,
    metrics: EngineMetrics,
) -> RemoteEncoderPool:
    """The engine core's client of the encoder pool (discovers every encoder; ValueError on
    one that is unreachable or serves another model). `embedding_width`: the model's encoder
    output row width (hidden size x (1 + DeepStack levels)), what every encoder must return.
    `media_config`: the local fallback's URL policy and decode limits, the same as the API
    process's."""
    assert pool.encoder_urls
    identity = ModelIdentity(
        fingerprint=model_fingerprint(model_dir),
        embedding_width=embedding_width,
        dtype=str(dtype).removeprefix("torch."),
    )
    local = None
    if pool.resolved_encoder_fallback == "local":
        local = LocalFallback(MediaLoader(media_config), image_config)
    config = PoolConfig(
        pool.encoder_urls,
        identity,
        fallback=pool.resolved_encoder_fallback,
        timeout_s=pool.resolved_encoder_timeout,
        secret=read_encoder_secret(pool),
    )
    return RemoteEncoderPool.start(config, metrics=metrics, local_fallback=local)
