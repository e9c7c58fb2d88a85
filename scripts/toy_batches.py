"""Turn toy examples into Qwen2-VL model inputs exactly as the shipped preprocessor config would.

Pictures are resized with the Qwen2-VL `smart_resize` rule and PIL bicubic resampling (what
`Qwen2VLImageProcessorPil` does), then rescaled, normalised and cut into 14x14x2 patches in numpy;
tests/models/test_toy_data.py checks the result against the transformers image processor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer
from toy_aux import picture_labels
from toy_data import Example, draw, render_prompt
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PixelConfig:
    """The fields of preprocessor_config.json that decide what the vision tower sees."""

    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2

    @classmethod
    def from_dict(cls, cfg: dict) -> PixelConfig:
        return cls(
            cfg["min_pixels"],
            cfg["max_pixels"],
            tuple(cfg["image_mean"]),
            tuple(cfg["image_std"]),
            cfg["patch_size"],
            cfg["temporal_patch_size"],
            cfg["merge_size"],
        )


def image_patches(image: Image.Image, px: PixelConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Patches [grid_h * grid_w, 3 * t * p * p] float32 and the grid (t, h, w) for one image."""
    factor = px.patch_size * px.merge_size
    height, width = smart_resize(image.height, image.width, factor, px.min_pixels, px.max_pixels)
    resized = image.convert("RGB").resize((width, height), Image.BICUBIC)
    pixels = np.asarray(resized).transpose(2, 0, 1)  # [3, H, W] uint8
    pixels = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(px.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(px.image_std, dtype=np.float32)[:, None, None]
    pixels = (pixels - mean) / std
    p, m, t = px.patch_size, px.merge_size, px.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    # Patches are ordered merge-window by merge-window so that each 2x2 window is contiguous.
    patches = pixels.reshape(3, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # [h/m, w/m, m, m, 3, p, p]
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    return patches.reshape(grid_h * grid_w, 3 * t * p * p), (1, grid_h, grid_w)


@dataclass(frozen=True)
class Encoded:
    """One example as token ids (image pads expanded) plus its images' patches."""

    prompt_ids: list[int]
    answer_ids: list[int]  # the answer's tokens followed by <|im_end|>
    patches: list[np.ndarray]
    grids: list[tuple[int, int, int]]
    aux: tuple[tuple[int, int, float, float], ...] = ()  # toy_aux.picture_labels per picture


@dataclass(frozen=True)
class SpecialIds:
    image_pad: int
    im_end: int
    pad: int

    @classmethod
    def from_vocab(cls, vocab: dict[str, int]) -> SpecialIds:
        return cls(vocab["<|image_pad|>"], vocab["<|im_end|>"], vocab["<|endoftext|>"])


def encode(
    example: Example, tok: Tokenizer, ids: SpecialIds, px: PixelConfig, chat_template: str
) -> Encoded:
    patches, grids = [], []
    for picture in example.pictures:
        pv, grid = image_patches(draw(picture), px)
        patches.append(pv)
        grids.append(grid)
    text_ids = tok.encode(render_prompt(example, chat_template), add_special_tokens=False).ids
    prompt_ids: list[int] = []
    image_idx = 0
    for token in text_ids:
        if token == ids.image_pad:
            t, h, w = grids[image_idx]
            prompt_ids.extend([ids.image_pad] * (t * h * w // px.merge_size**2))
            image_idx += 1
        else:
            prompt_ids.append(token)
    assert image_idx == len(grids), "every picture needs exactly one <|image_pad|>"
    answer_ids = tok.encode(example.answer, add_special_tokens=False).ids + [ids.im_end]
    aux = tuple(picture_labels(p) for p in example.pictures)
    return Encoded(prompt_ids, answer_ids, patches, grids, aux)


def collate(
    batch: list[Encoded], ids: SpecialIds, with_answers: bool = True
) -> dict[str, torch.Tensor]:
    """Right-padded model inputs; labels cover only the answer tokens and <|im_end|>."""
    seqs = [e.prompt_ids + (e.answer_ids if with_answers else []) for e in batch]
    max_len = max(len(s) for s in seqs)
    input_ids = torch.full((len(batch), max_len), ids.pad, dtype=torch.long)  # [B, L]
    labels = torch.full((len(batch), max_len), IGNORE_INDEX, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros((len(batch), max_len), dtype=torch.long)  # [B, L]
    for i, (e, seq) in enumerate(zip(batch, seqs, strict=True)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention_mask[i, : len(seq)] = 1
        if with_answers:
            labels[i, len(e.prompt_ids) : len(seq)] = torch.tensor(e.answer_ids)
    pixel_values = torch.from_numpy(np.concatenate([p for e in batch for p in e.patches]))
    grids = torch.tensor([g for e in batch for g in e.grids], dtype=torch.long)  # [num_images, 3]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "pixel_values": pixel_values,  # [num_patches, 1176]
        "image_grid_thw": grids,
        "mm_token_type_ids": (input_ids == ids.image_pad).long(),
    }
