"""Admission checks: refuse, at add time, a request the scheduler could never run to the end."""

from __future__ import annotations

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.errors import EncoderItemTooLargeError, InvalidRequestError, PromptTooLongError
from mmserve.scheduling.request import Request


def validate_request(
    request: Request, scheduler_config: SchedulerConfig, cache_config: CacheConfig
) -> None:
    """Raise a typed error (a 4xx for the API) naming the limit and the fix; return if OK."""
    num_prompt = request.num_prompt_tokens
    max_model_len = scheduler_config.max_model_len
    if num_prompt == 0:
        raise InvalidRequestError("the prompt is empty; send at least one token", param="prompt")
    if num_prompt > max_model_len:
        raise PromptTooLongError(
            f"the prompt is {num_prompt} tokens (images included) but max_model_len is "
            f"{max_model_len}; shorten the prompt, send fewer or smaller images (lower "
            f"max_pixels), or raise --max-model-len",
            param="messages",
        )
    if request.max_tokens < 1:
        raise InvalidRequestError(
            f"max_tokens must be at least 1, got {request.max_tokens}", param="max_tokens"
        )
    _validate_items(request, scheduler_config)
    _validate_kv_capacity(request, scheduler_config, cache_config)


def _validate_items(request: Request, config: SchedulerConfig) -> None:
    cache_size = config.effective_encoder_cache_size
    compute_budget = config.effective_encoder_compute_budget
    prev_end = 0
    for feature in request.mm_features:
        offset, length = feature.placeholder.offset, feature.placeholder.length
        if length <= 0 or offset < prev_end or offset + length > request.num_prompt_tokens:
            raise InvalidRequestError(
                f"multimodal item {feature.identifier[:16]}… has placeholder range "
                f"[{offset}, {offset + length}) that is empty, overlaps the previous item or "
                f"lies outside the {request.num_prompt_tokens}-token prompt",
                param="messages",
            )
        prev_end = offset + length
        limit = min(cache_size, compute_budget)
        if config.disable_chunked_mm_input:
            limit = min(limit, config.max_num_batched_tokens)
        if length > limit:
            raise EncoderItemTooLargeError(
                f"one {feature.modality} item needs {length} encoder embeddings but at most "
                f"{limit} fit "
                f"(encoder cache {cache_size} slots, encoder budget {compute_budget} per step"
                + (
                    f", --max-num-batched-tokens {config.max_num_batched_tokens} with "
                    f"--disable-chunked-mm-input"
                    if config.disable_chunked_mm_input
                    else ""
                )
                + "); send a smaller image (lower max_pixels) or raise --encoder-cache-size / "
                "--max-num-batched-tokens",
                param="messages",
            )


def _validate_kv_capacity(
    request: Request, scheduler_config: SchedulerConfig, cache_config: CacheConfig
) -> None:
    """Even alone in the engine, the request must fit in the KV pool up to its last token."""
    block_size = cache_config.block_size
    capacity_tokens = cache_config.num_blocks * block_size
    if request.num_prompt_tokens > capacity_tokens:
        raise PromptTooLongError(
            f"the prompt is {request.num_prompt_tokens} tokens but the KV cache holds "
            f"{capacity_tokens}; shorten the prompt or give the engine more KV memory",
            param="messages",
        )
    # KV is written for every token but the last sampled one (and a full-length prompt).
    num_prompt = request.num_prompt_tokens
    last_len = min(num_prompt + request.max_tokens, scheduler_config.max_model_len) - 1
    if max(num_prompt, last_len) > capacity_tokens:
        raise InvalidRequestError(
            f"prompt + max_tokens needs KV for {last_len} tokens but the KV cache holds "
            f"{capacity_tokens}; lower max_tokens to at most {capacity_tokens - num_prompt + 1}",
            param="max_tokens",
        )
