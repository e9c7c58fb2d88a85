"""Qwen2-VL / Qwen2.5-VL against transformers: vision features, logits, greedy generation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.errors import RequestFailedError
from mmserve.layers.attention import TorchAttentionBackend
from mmserve.models.kv_cache import allocate_kv_caches
from mmserve.processing.mrope import get_mrope_positions
from tests.models.driver import Prompt, build_prompt, generate_paged
from tests.support.oracle import LoadedPair

TWO_IMAGES = [
    "Describe the first picture.",
    (100, 60),
    "and then the second one, please:",
    (130, 90),
    " Which is red?",
]


def _hf_inputs(prompt: Prompt) -> dict:
    inputs = {
        "input_ids": torch.tensor([prompt.input_ids]),
        "attention_mask": torch.ones(1, len(prompt.input_ids), dtype=torch.long),
    }
    if prompt.pixel_values is not None:
        inputs["pixel_values"] = prompt.pixel_values
        inputs["image_grid_thw"] = torch.tensor(prompt.grid_thw)
        inputs["mm_token_type_ids"] = torch.tensor([prompt.mm_token_type_ids])
    return inputs


def _prefill_logits(loaded: LoadedPair, prompt: Prompt, chunk: int) -> torch.Tensor:
    """All prompt logits from our model, the prompt fed in chunks of `chunk` tokens."""
    model, config = loaded.model, loaded.config
    mm = torch.cat(model.embed_multimodal(prompt.pixel_values, prompt.grid_thw))
    embeds = model.embed_input_ids(torch.tensor(prompt.input_ids), mm)
    positions, _ = get_mrope_positions(
        prompt.input_ids,
        prompt.grid_thw,
        image_token_id=config.image_token_id,
        video_token_id=config.video_token_id,
        spatial_merge_size=config.vision.spatial_merge_size,
    )
    n, block_size = len(prompt.input_ids), 8
    blocks = list(range(-(-n // block_size)))[::-1]  # reversed: a non-trivial block layout
    kv_caches = allocate_kv_caches(config, len(blocks), block_size, "cpu", torch.float32)
    logits = []
    with torch.inference_mode():
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            meta = TorchAttentionBackend().build_metadata(
                [end - start], [end], [blocks], block_size
            )
            hidden = model(
                None,
                torch.from_numpy(positions[:, start:end]),
                meta,
                kv_caches,
                inputs_embeds=embeds[start:end],
            )
            logits.append(model.compute_logits(hidden))
    return torch.cat(logits)


def test_vision_features_match_transformers(loaded: LoadedPair) -> None:
    prompt = build_prompt(
        loaded.model_dir, loaded.config, [(100, 60), (230, 150), (56, 56), (60, 300)], seed=3
    )
    with torch.inference_mode():
        ours = loaded.model.embed_multimodal(prompt.pixel_values, prompt.grid_thw)
        ref = loaded.hf.model.get_image_features(
            prompt.pixel_values, torch.tensor(prompt.grid_thw)
        ).pooler_output
    assert len(ours) == len(ref) == 4
    merge = loaded.config.vision.spatial_merge_size
    for (t, h, w), a, b in zip(prompt.grid_thw, ours, ref, strict=True):
        assert a.shape == (t * h * w // merge**2, loaded.config.hidden_size)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [10_000, 37])
def test_prompt_logits_match_transformers(loaded: LoadedPair, chunk: int) -> None:
    prompt = build_prompt(loaded.model_dir, loaded.config, TWO_IMAGES)
    assert len(set(prompt.grid_thw)) == 2
    with torch.inference_mode():
        ref = loaded.hf(**_hf_inputs(prompt)).logits[0]
    ours = _prefill_logits(loaded, prompt, chunk)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def _hf_greedy(loaded: LoadedPair, prompt: Prompt, max_new_tokens: int) -> list[int]:
    from transformers import GenerationConfig

    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0
    )
    with torch.inference_mode():
        out = loaded.hf.generate(**_hf_inputs(prompt), generation_config=gen)
    return out[0, len(prompt.input_ids) :].tolist()


def test_greedy_generation_matches_transformers(loaded: LoadedPair) -> None:
    prompts = [
        build_prompt(loaded.model_dir, loaded.config, TWO_IMAGES),
        build_prompt(loaded.model_dir, loaded.config, ["Hello, what is", (84, 84), "?"], seed=7),
        build_prompt(loaded.model_dir, loaded.config, ["The quick brown fox jumps"]),
    ]
    expected = [_hf_greedy(loaded, p, 32) for p in prompts]
    # One request alone, prompt in a single prefill.
    assert generate_paged(loaded.model, loaded.config, prompts[:1], 32, [10_000]) == expected[:1]
    # The same, prompt fed in chunks of 13 tokens (chunks cut through the images).
    assert generate_paged(loaded.model, loaded.config, prompts[:1], 32, [13]) == expected[:1]
    # All requests in one flat batch: prefill chunks of one run next to decodes of others.
    assert generate_paged(loaded.model, loaded.config, prompts, 32, [7, 40, 3], seed=1) == expected


def test_placeholder_count_mismatch_is_a_loud_error(loaded: LoadedPair) -> None:
    prompt = build_prompt(loaded.model_dir, loaded.config, ["look", (56, 56)])
    mm = torch.cat(loaded.model.embed_multimodal(prompt.pixel_values, prompt.grid_thw))
    with pytest.raises(RequestFailedError, match=r"= 4 multimodal tokens to 3 placeholders"):
        loaded.model.embed_input_ids(torch.tensor(prompt.input_ids[:-2]), mm)


def test_pixel_values_shape_is_checked(loaded: LoadedPair) -> None:
    pixels = torch.zeros(15, loaded.config.vision.patch_input_dim)
    with pytest.raises(ValueError, match="expected \\(16, 1176\\)"):
        loaded.model.embed_multimodal(pixels, [(1, 4, 4)])


def test_text_only_positions_are_plain_rope(loaded: LoadedPair) -> None:
    """With no images, positions are 0..n-1 on every axis and the delta is 0."""
    ids = list(range(20))
    positions, delta = get_mrope_positions(
        ids,
        (),
        image_token_id=loaded.config.image_token_id,
        video_token_id=loaded.config.video_token_id,
        spatial_merge_size=2,
    )
    assert delta == 0
    np.testing.assert_array_equal(positions, np.tile(np.arange(20), (3, 1)))


def test_video_and_multi_frame_items_match_transformers(loaded: LoadedPair) -> None:
    """Items with t > 1 (frames attend separately, windows per frame) next to images."""
    torch.manual_seed(0)
    grids = [(2, 8, 12), (1, 4, 8), (3, 4, 4)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), loaded.config.vision.patch_input_dim)
    with torch.inference_mode():
        ours = torch.cat(loaded.model.embed_multimodal(pixels, grids))
        ref = loaded.hf.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_video_prompt_logits_match_transformers(loaded: LoadedPair) -> None:
    """Video placeholders, video M-RoPE (Qwen2.5-VL: tokens_per_second spacing) and splicing."""
    config = loaded.config
    torch.manual_seed(1)
    grid = (3, 8, 12)
    pixels = torch.randn(3 * 8 * 12, config.vision.patch_input_dim)
    num_embeds = 3 * 8 * 12 // config.vision.spatial_merge_size**2
    ids = [5, 6, 7, config.vision_start_token_id] + [config.video_token_id] * num_embeds
    ids += [config.vision_end_token_id, 8, 9, 10]
    seconds = [0.9]  # with tokens_per_second=2: temporal interval 1.8 -> 0, 1, 3
    kwargs = {"second_per_grid_ts": torch.tensor(seconds)} if config.vision.is_windowed else {}
    with torch.inference_mode():
        ref = loaded.hf(
            input_ids=torch.tensor([ids]),
            pixel_values_videos=pixels,
            video_grid_thw=torch.tensor([grid]),
            mm_token_type_ids=torch.tensor([[2 * (t == config.video_token_id) for t in ids]]),
            **kwargs,
        ).logits[0]
        positions, _ = get_mrope_positions(
            ids,
            (),
            image_token_id=config.image_token_id,
            video_token_id=config.video_token_id,
            spatial_merge_size=config.vision.spatial_merge_size,
            video_grid_thw=[grid],
            second_per_grid_ts=seconds,
            tokens_per_second=config.vision.tokens_per_second,
        )
        mm = loaded.model.embed_multimodal(pixels, [grid])[0]
        embeds = loaded.model.embed_input_ids(torch.tensor(ids), mm)
        meta = TorchAttentionBackend().build_metadata(
            [len(ids)], [len(ids)], [[3, 1, 0, 2, 5, 4, 6, 9, 8, 7]], 8
        )
        kv = allocate_kv_caches(config, 10, 8, "cpu", torch.float32)
        hidden = loaded.model(None, torch.from_numpy(positions), meta, kv, inputs_embeds=embeds)
        ours = loaded.model.compute_logits(hidden)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
