"""EngineShape: what both processes derive from the flags and the checkpoint's config files.

Torch-free, so the API process can build its side from it: the device and the dtype (and the
encoder cache's bytes per embedding: the model's encoder output row width, hidden size x (1 +
DeepStack levels), times the dtype's size) are the engine core's to resolve
(`engine.core.build`), and the API side admits requests by the budgets the core reports.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from mmserve.config.engine import EngineConfig
from mmserve.config.media import MediaConfig
from mmserve.config.scheduler import SchedulerConfig
from mmserve.models.config import ModelConfig, load_model_config
from mmserve.processing.image_processor import ImageProcessorConfig
from mmserve.processing.tokenizer import Tokenizer
from mmserve.processing.video_inputs import (
    largest_item_tokens,
    load_video_config,
    split_processor_kwargs,
)


@dataclass(frozen=True)
class EngineShape:
    """The model's shape and the budgets before any weight is loaded (no device, no dtype)."""

    model_dir: Path
    model_config: ModelConfig
    max_model_len: int
    image_config: ImageProcessorConfig  # with --mm-processor-kwargs applied
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    # every budget but the encoder cache's bytes per embedding (row width x dtype size: the
    # core sets it, `engine.core.build.encoder_embed_bytes`)
    scheduler_config: SchedulerConfig


def resolve_shape(config: EngineConfig) -> EngineShape:
    model_dir = Path(config.checkpoint.model)
    if not (model_dir / "config.json").is_file():
        raise ValueError(
            f"--model {config.checkpoint.model}: no config.json there; is it a model directory?"
        )
    model_config = load_model_config(model_dir)
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
        patches_per_embed=merge * merge,
    )
    return EngineShape(
        model_dir,
        model_config,
        max_model_len,
        image_config,
        tokenizer,
        eos_token_ids,
        scheduler_config,
    )


def loader_media_config(
    media: MediaConfig, shape: EngineShape, *, decode_workers: int
) -> MediaConfig:
    """The media flags as a loader runs them: the pixel cap resolved against the processor."""
    return media.for_loader(
        processor_max_pixels=shape.image_config.max_pixels, decode_workers=decode_workers
    )
