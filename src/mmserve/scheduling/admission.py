"""Admission checks: refuse, before a request is queued, one the scheduler could never run.

They run once per request, in the front end (`engine.llm_engine.LLMEngine.add_request`, in the
API process when the core runs in its own): the engine core trusts what it is sent and builds
its one scheduler `Request` from it.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.errors import EncoderItemTooLargeError, InvalidRequestError, PromptTooLongError
from mmserve.multimodal import MultiModalFeature


def validate_request(
    num_prompt_tokens: int,
    max_tokens: int,
    mm_features: Sequence[MultiModalFeature],
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
) -> None:
    """Raise a typed error (a 4xx for the API) naming the limit and the fix; return if OK.
    `max_tokens` is the resolved one (`sampling_params.resolve_max_tokens`)."""
    num_prompt = num_prompt_tokens
    max_model_len = scheduler_config.max_model_len
    if num_prompt == 0:
        raise InvalidRequestError("the prompt is empty; send at least one token", param="prompt")
    if num_prompt > max_model_len:
        raise PromptTooLongError(
            f"the prompt is {num_prompt} tokens (images and videos included) but max_model_len "
            f"is {max_model_len}; shorten the prompt, send fewer or smaller images or shorter "
            f"videos (lower max_pixels, fps or max_frames), or raise --max-model-len",
            param="messages",
        )
    if max_tokens < 1:
        raise InvalidRequestError(
            f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens"
        )
    _validate_items(num_prompt, mm_features, scheduler_config)
    _validate_kv_capacity(num_prompt, max_tokens, scheduler_config, cache_config)


def _validate_items(
    num_prompt: int, mm_features: Sequence[MultiModalFeature], config: SchedulerConfig
) -> None:
    prev_end = 0
    ordinals: dict[str, int] = {}
    for feature in mm_features:
        offset, length = feature.placeholder.offset, feature.placeholder.length
        if length <= 0 or offset < prev_end or offset + length > num_prompt:
            raise InvalidRequestError(
                f"multimodal item {feature.identifier[:16]}… has placeholder range "
                f"[{offset}, {offset + length}) that is empty, overlaps the previous item or "
                f"lies outside the {num_prompt}-token prompt",
                param="messages",
            )
        prev_end = offset + length
        ordinals[feature.modality] = ordinals.get(feature.modality, 0) + 1
        _check_item_fits(feature, f"{feature.modality} {ordinals[feature.modality]}", config)


def _check_item_fits(feature: MultiModalFeature, name: str, config: SchedulerConfig) -> None:
    """An item that can never be encoded (patch budget), held (cache bytes) or, unchunked,
    scheduled (token budget) would wait forever: refuse it now, naming the flag to raise."""
    smaller = "send a smaller or shorter item (lower max_pixels, fps or max_frames)"
    if config.disable_chunked_mm_input and feature.num_embeds > config.max_num_batched_tokens:
        raise EncoderItemTooLargeError(
            f"{name} of the prompt is {feature.num_embeds} tokens, over --max-num-batched-tokens "
            f"{config.max_num_batched_tokens}, and --disable-chunked-mm-input forbids splitting "
            f"it; {smaller} or raise --max-num-batched-tokens",
            param="messages",
        )
    budget = config.effective_encoder_patch_budget
    if feature.num_patches > budget:
        raise EncoderItemTooLargeError(
            f"{name} of the prompt is {feature.num_patches} input patches (grid_thw "
            f"{tuple(feature.grid_thw)}) but the vision encoder processes at most {budget} per "
            f"step; {smaller} or raise --encoder-patch-budget",
            param="messages",
        )
    cache_bytes = config.effective_encoder_cache_bytes
    item_bytes = feature.num_embeds * config.encoder_embed_bytes
    if item_bytes > cache_bytes:
        raise EncoderItemTooLargeError(
            f"{name} of the prompt needs {item_bytes} bytes of encoder cache "
            f"({feature.num_embeds} embeddings) but the cache holds {cache_bytes} bytes; "
            f"{smaller} or raise --encoder-cache-bytes (or --encoder-cache-size)",
            param="messages",
        )


def _validate_kv_capacity(
    num_prompt: int, max_tokens: int, scheduler_config: SchedulerConfig, cache_config: CacheConfig
) -> None:
    """Even alone in the engine, the request must fit in the KV pool up to its last token."""
    block_size = cache_config.block_size
    capacity_tokens = cache_config.num_blocks * block_size
    if num_prompt > capacity_tokens:
        raise PromptTooLongError(
            f"the prompt is {num_prompt} tokens but the KV cache holds "
            f"{capacity_tokens}; shorten the prompt or give the engine more KV memory",
            param="messages",
        )
    # KV is written for every token but the last sampled one (and a full-length prompt).
    last_len = min(num_prompt + max_tokens, scheduler_config.max_model_len) - 1
    if max(num_prompt, last_len) > capacity_tokens:
        raise InvalidRequestError(
            f"prompt + max_tokens needs KV for {last_len} tokens but the KV cache holds "
            f"{capacity_tokens}; lower max_tokens to at most {capacity_tokens - num_prompt + 1}",
            param="max_tokens",
        )
