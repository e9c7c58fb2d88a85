"""Test-side helpers: build multimodal prompts and drive a model through a paged KV cache.

`generate_paged` is a deliberately small stand-in for the engine: it hands out KV blocks from a
shuffled free list (so block tables are scattered), feeds prompts in chunks, batches every
running request into one flat forward per step and decodes greedily.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from mmserve.layers.attention import TorchAttentionBackend
from mmserve.models.config import ModelConfig
from mmserve.models.kv_cache import allocate_kv_caches
from mmserve.processing.mrope import decode_positions, get_mrope_positions
from tests.support.factory import random_image


@dataclass
class Prompt:
    input_ids: list[int]
    pixel_values: torch.Tensor | None  # [num_patches, C*T*P*P]
    grid_thw: list[tuple[int, int, int]]
    mm_token_type_ids: list[int]  # 1 at image placeholders, else 0 (transformers 5 wants it)


def build_prompt(
    model_dir: Path, config: ModelConfig, parts: list[str | tuple[int, int]], seed: int = 0
) -> Prompt:
    """A prompt from text pieces and (width, height) images, placeholders expanded."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    merge = config.vision.spatial_merge_size
    images = [
        random_image(p[0], p[1], seed=seed + i)
        for i, p in enumerate(p for p in parts if not isinstance(p, str))
    ]
    pixel_values, grids = None, []
    if images:
        out = processor(images=images, return_tensors="pt")
        pixel_values = out["pixel_values"]
        grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()]
    ids: list[int] = []
    image_iter = iter(grids)
    for part in parts:
        if isinstance(part, str):
            ids += tok.encode(part).ids
        else:
            t, h, w = next(image_iter)
            ids += [config.vision_start_token_id]
            ids += [config.image_token_id] * (t * h * w // merge**2)
            ids += [config.vision_end_token_id]
    type_ids = [int(t == config.image_token_id) for t in ids]
    return Prompt(ids, pixel_values, grids, type_ids)


@dataclass
class _Seq:
    prompt_len: int
    embeds: torch.Tensor  # [prompt_len, hidden]
    positions: np.ndarray  # [3, prompt_len]
    delta: int
    token_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0


def generate_paged(
    model: torch.nn.Module,
    config: ModelConfig,
    prompts: list[Prompt],
    max_new_tokens: int,
    chunk_sizes: list[int],
    block_size: int = 4,
    num_blocks: int = 256,
    seed: int = 0,
) -> list[list[int]]:
    """Greedy continuations of `prompts`, all requests batched in each step."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    dtype = next(model.parameters()).dtype
    kv_caches = allocate_kv_caches(config, num_blocks, block_size, "cpu", dtype)
    seqs = []
    for p in prompts:
        mm = None
        if p.pixel_values is not None:
            mm = torch.cat(model.embed_multimodal(p.pixel_values, p.grid_thw))
        ids = torch.tensor(p.input_ids)
        positions, delta = get_mrope_positions(
            p.input_ids,
            p.grid_thw,
            image_token_id=config.image_token_id,
            video_token_id=config.video_token_id,
            spatial_merge_size=config.vision.spatial_merge_size,
        )
        seqs.append(_Seq(len(ids), model.embed_input_ids(ids, mm), positions, delta))
    while any(len(s.token_ids) < max_new_tokens for s in seqs):
        batch = [(i, s) for i, s in enumerate(seqs) if len(s.token_ids) < max_new_tokens]
        embeds, positions, q_lens, seq_lens = [], [], [], []
        for i, s in batch:
            if s.num_computed < s.prompt_len:
                n = min(chunk_sizes[i], s.prompt_len - s.num_computed)
                embeds.append(s.embeds[s.num_computed : s.num_computed + n])
                positions.append(s.positions[:, s.num_computed : s.num_computed + n])
            else:
                n = 1
                embeds.append(model.embed_input_ids(torch.tensor(s.token_ids[-1:])))
                positions.append(decode_positions(s.num_computed, 1, s.delta))
            s.num_computed += n
            while len(s.blocks) * block_size < s.num_computed:
                s.blocks.append(free.pop())
            q_lens.append(n)
            seq_lens.append(s.num_computed)
        meta = TorchAttentionBackend().build_metadata(
            q_lens, seq_lens, [s.blocks for _, s in batch], block_size
        )
        with torch.inference_mode():
            hidden = model(
                None,
                torch.from_numpy(np.concatenate(positions, axis=1)),
                meta,
                kv_caches,
                inputs_embeds=torch.cat(embeds),
            )
            last = torch.tensor(meta.query_start_loc_cpu[1:]) - 1
            next_ids = model.compute_logits(hidden[last]).argmax(-1).tolist()
        for (_, s), token in zip(batch, next_ids, strict=True):
            if s.num_computed >= s.prompt_len:
                s.token_ids.append(int(token))
    return [s.token_ids for s in seqs]
