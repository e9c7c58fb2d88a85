"""Prompts with videos built by transformers alone: the engine is checked against the oracle
independently of mmserve's own processing.

`Qwen2VLVideoProcessor` makes the pixels and grids of already sampled frames, the checkpoint's
`get_rope_index` the M-RoPE positions (with `second_per_grid_ts` for Qwen2.5-VL); the result
is both a `ProcessedPrompt` for the engine core and the keyword arguments of `generate`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.multimodal import (
    EncoderInput,
    MultiModalFeature,
    NormalizationOrder,
    PixelNormalization,
    PlaceholderRange,
    ProcessedPrompt,
)
from tests.support.oracle import HFOracle

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VID = "<|vision_start|><|video_pad|><|vision_end|>"
# Frames given as an array count as sampled at 2 fps (issue #17): with temporal_patch_size 2,
# one temporal patch spans one second.
FRAMES_FPS = 2.0
MERGE = 2


def random_video(num_frames: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """[num_frames, height, width, 3] uint8 frames."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(num_frames, height, width, 3), dtype=np.uint8)


@dataclass(frozen=True)
class OracleCase:
    prompt: ProcessedPrompt  # for `LLMEngine.add_request`
    hf_inputs: dict[str, torch.Tensor]  # for transformers' `generate`


def _identifier(pixels: np.ndarray, grid_thw: tuple[int, int, int]) -> str:
    return hashlib.sha256(repr(grid_thw).encode() + pixels.tobytes()).hexdigest()


def _items(
    pixel_values: torch.Tensor, levels: torch.Tensor, grids: torch.Tensor, norm: PixelNormalization
) -> list[tuple[np.ndarray, tuple]]:
    """Each item's uint8 rows of the batched pixel array, with its grid.

    `levels` is the same processor's output with rescale and normalise switched off: the uint8
    levels (as floats) the engine receives. They must normalise to transformers' values bit
    for bit, or the engine would not see what transformers' model sees.
    """
    as_uint8 = levels.numpy().astype(np.uint8)
    assert np.array_equal(as_uint8, levels.numpy()), "levels are not whole numbers in 0..255"
    np.testing.assert_array_equal(norm.apply(as_uint8), pixel_values.numpy())
    out, start = [], 0
    for grid in grids.tolist():
        num_patches = grid[0] * grid[1] * grid[2]
        out.append((as_uint8[start : start + num_patches], tuple(grid)))
        start += num_patches
    return out


def _normalization(processor, order: NormalizationOrder) -> PixelNormalization:
    mean, std = (
        tuple(float(v) for v in processor.image_mean),
        tuple(float(v) for v in processor.image_std),
    )
    return PixelNormalization(
        mean,
        std,
        float(processor.rescale_factor),
        True,
        True,
        order,  # type: ignore[arg-type]
    )


def build_case(
    oracle: HFOracle, text: str, images: list, videos: list[np.ndarray], *, max_pixels: int
) -> OracleCase:
    """`text` holds one IMG / VID marker per item, in the order of `images` / `videos`."""
    from transformers import Qwen2VLVideoProcessor

    hf: dict[str, torch.Tensor] = {}
    queues: dict[str, list] = {"image": [], "video": []}
    norms: dict[str, PixelNormalization] = {}
    if images:
        feats = oracle.processor(images=images, return_tensors="pt")
        levels = oracle.processor(
            images=images, do_rescale=False, do_normalize=False, return_tensors="pt"
        )["pixel_values"]
        hf["pixel_values"], hf["image_grid_thw"] = feats["pixel_values"], feats["image_grid_thw"]
        norms["image"] = _normalization(oracle.processor, "rescale_then_normalize")
        queues["image"] = _items(
            feats["pixel_values"], levels, feats["image_grid_thw"], norms["image"]
        )
    seconds = None
    if videos:
        processor = Qwen2VLVideoProcessor(min_pixels=56 * 56, max_pixels=max_pixels)
        kwargs = dict(do_sample_frames=False, cap_pixels_per_frame=False, return_tensors="pt")
        feats = processor(videos=videos, **kwargs)
        levels = processor(videos=videos, do_rescale=False, do_normalize=False, **kwargs)
        hf["pixel_values_videos"] = feats["pixel_values_videos"]
        hf["video_grid_thw"] = feats["video_grid_thw"]
        norms["video"] = _normalization(processor, "normalize_scaled")
        queues["video"] = _items(
            feats["pixel_values_videos"],
            levels["pixel_values_videos"],
            feats["video_grid_thw"],
            norms["video"],
        )
        seconds = processor.temporal_patch_size / FRAMES_FPS
        if "second_per_grid_ts" in _rope_parameters(oracle):
            hf["second_per_grid_ts"] = torch.tensor([seconds] * len(videos))

    config = oracle.model.config
    pad_modality = {config.image_token_id: "image", config.video_token_id: "video"}
    ids: list[int] = []
    types: list[int] = []
    features: list[MultiModalFeature] = []
    mm_data: dict[str, EncoderInput] = {}
    for token in oracle.tok.encode(text, add_special_tokens=False).ids:
        modality = pad_modality.get(token)
        if modality is None:
            ids.append(token)
            types.append(0)
            continue
        pixels, grid = queues[modality].pop(0)
        num_embeds = grid[0] * grid[1] * grid[2] // MERGE**2
        data = EncoderInput(pixels, grid, norms[modality], seconds if modality == "video" else None)
        placeholder = PlaceholderRange(len(ids), num_embeds)
        features.append(MultiModalFeature(_identifier(pixels, grid), modality, placeholder, grid))
        mm_data[features[-1].identifier] = data
        ids += [token] * num_embeds
        types += [1 if modality == "image" else 2] * num_embeds
    assert not queues["image"] and not queues["video"], "more items than markers"

    input_ids = torch.tensor([ids])
    hf.update(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        mm_token_type_ids=torch.tensor([types]),
    )
    rope_kwargs = {k: hf[k] for k in _rope_parameters(oracle) if k in hf}
    positions, delta = oracle.model.model.get_rope_index(
        input_ids, hf["mm_token_type_ids"], **rope_kwargs
    )  # [3, 1, num_tokens], [1, 1]
    prompt = ProcessedPrompt(
        prompt_token_ids=ids,
        mm_features=features,
        mrope_positions=positions[:, 0].numpy().astype(np.int64),
        mrope_position_delta=int(delta.item()),
        mm_data=mm_data,
        prompt=text,
    )
    return OracleCase(prompt, hf)


def _rope_parameters(oracle: HFOracle) -> tuple[str, ...]:
    import inspect

    names = inspect.signature(oracle.model.model.get_rope_index).parameters
    wanted = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
    return tuple(n for n in wanted if n in names)


@torch.no_grad()
def oracle_greedy(oracle: HFOracle, case: OracleCase, max_new_tokens: int) -> list[int]:
    inputs = dict(case.hf_inputs)
    n = inputs["input_ids"].shape[1]
    out = oracle.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, n:].tolist()
