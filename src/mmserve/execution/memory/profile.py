"""The start-up profile run: the ViT at the encoder budget, the LM at the token budget and the
sampler over the largest batch at its most expensive settings, once, to read the activation
peak that the KV cache must leave free (`kv_sizing.py`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from mmserve.execution.memory.device import DeviceMemory, MemorySnapshot
from mmserve.execution.sample.rows import SamplingRow
from mmserve.execution.sample.sampler import make_device_generator
from mmserve.execution.sample.step import sample_step
from mmserve.grid import grid_num_patches
from mmserve.layers.attention import AttentionBackend
from mmserve.layers.parallel import SINGLE, TPGroup
from mmserve.models.config import ModelConfig
from mmserve.models.kv_cache import allocate_kv_caches
from mmserve.sampling_params import SamplingParams

# The sampler's costliest settings: temperature, top-k and top-p (a full-vocabulary sort), and
# every penalty (per-row token counts over the vocabulary); logprobs at --max-logprobs.
_PROFILE_SAMPLING = dict(
    temperature=0.7,
    top_k=50,
    top_p=0.9,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    repetition_penalty=1.1,
)


@dataclass(frozen=True)
class ProfileShape:
    """The largest step the engine will run (what its budgets allow)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    max_patches_per_call: int  # the encoder's per-call budget, in input patches
    max_tokens_per_mm_item: int  # in merged tokens
    block_size: int
    max_logprobs: int  # --max-logprobs: the widest logprobs table a row may ask for


@dataclass(frozen=True)
class MemoryFigures:
    """What the profile run measured, in bytes."""

    total_bytes: int  # the device's memory
    free_bytes: int  # free on the device after the run, its cached blocks handed back
    weights_bytes: int  # held by live tensors before the run: weights, persistent buffers
    activation_peak_bytes: int  # the run's peak above what was live when it began
    non_torch_bytes: int  # this process's growth outside torch's allocator since start-up
    encoder_grids: tuple[tuple[int, int, int], ...]  # what the ViT ran
    lm_seq_lens: tuple[int, ...]  # what the LM ran: one prefill per entry
    num_sampled_rows: int  # what the LM head and the sampler ran on


def encoder_profile_grids(
    max_patches_per_call: int, max_tokens_per_item: int, merge: int
) -> list[tuple[int, int, int]]:
    """Image grids (t, h, w) that fill one encoder call: as many of the largest item as fit,
    then one for the rest. Each is near-square (an aspect ratio smart_resize allows) with h and
    w multiples of `merge`; together they hold at most `max_patches_per_call` patches."""
    budget_tokens = max(1, max_patches_per_call // merge**2)
    item_tokens = max(1, min(max_tokens_per_item, budget_tokens))
    sizes = [item_tokens] * (budget_tokens // item_tokens)
    if budget_tokens % item_tokens:
        sizes.append(budget_tokens % item_tokens)
    grids = []
    for tokens in sizes:
        rows = math.isqrt(tokens)
        grids.append((1, rows * merge, tokens // rows * merge))
    return grids


def lm_profile_seq_lens(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """One step of `max_num_batched_tokens` new tokens as fresh prefills of at most
    `max_model_len` tokens each."""
    full, rest = divmod(max_num_batched_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


@torch.inference_mode()
def profile_memory(
    model: nn.Module,
    model_config: ModelConfig,
    attention_backend: AttentionBackend,
    shape: ProfileShape,
    memory: DeviceMemory,
    at_start: MemorySnapshot,
    *,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPGroup = SINGLE,
) -> MemoryFigures:
    """Run the ViT and the LM once at their budgets and read the device's figures.

    `at_start` is the snapshot taken before the weights were loaded. The LM attends over a
    dummy KV cache of one block per layer that every block table entry points at: its values
    do not matter, and the real pool's memory is what this run decides. `tp`: the rank's group
    (the dummy cache holds its KV heads; the model's collectives run with the other ranks').
    """
    memory.synchronize()
    weights_bytes = memory.allocated_bytes()
    kv_caches = allocate_kv_caches(model_config, 1, shape.block_size, device, dtype, tp)
    live_before_bytes = memory.allocated_bytes()
    memory.reset_peak()
    merge = model_config.spatial_merge_size
    grids = encoder_profile_grids(shape.max_patches_per_call, shape.max_tokens_per_mm_item, merge)
    num_patches = sum(grid_num_patches(grid) for grid in grids)
    # [num_patches, C*T*P*P]
    pixels = torch.zeros(
        num_patches, model_config.vision.patch_input_dim, dtype=dtype, device=device
    )
    embeds = model.embed_multimodal(pixels, grids)
    del pixels, embeds
    seq_lens = lm_profile_seq_lens(shape.max_num_batched_tokens, shape.max_model_len)
    mm_rows = (model_config.mm_embedding_width, dtype)
    num_rows = _run_lm(model, attention_backend, kv_caches, seq_lens, shape, device, mm_rows)
    memory.synchronize()
    activation_peak_bytes = max(0, memory.peak_allocated_bytes() - live_before_bytes)
    del kv_caches
    memory.empty_cache()
    after = memory.snapshot()
    return MemoryFigures(
        total_bytes=after.total_bytes,
        free_bytes=after.free_bytes,
        weights_bytes=weights_bytes,
        activation_peak_bytes=activation_peak_bytes,
        non_torch_bytes=max(0, after.outside_torch_bytes - at_start.outside_torch_bytes),
        encoder_grids=tuple(grids),
        lm_seq_lens=tuple(seq_lens),
        num_sampled_rows=num_rows,
    )


def _run_lm(
    model: nn.Module,
    attention_backend: AttentionBackend,
    kv_caches: list[torch.Tensor],
    seq_lens: list[int],
    shape: ProfileShape,
    device: torch.device,
    mm_rows: tuple[int, torch.dtype],
) -> int:
    """One forward over `seq_lens` fresh prefills, then the LM head and the sampler on as many
    rows as a step samples at most; the number of rows. `mm_rows`: the width and dtype of the
    encoder cache's rows.

    NOTE: every token is spliced as an image's: a step's gathered encoder rows
    ([num_tokens, mm_embedding_width], the main embedding and every DeepStack level) stay live
    through its forward and sampling, and the model may keep parts of them (DeepStack levels
    for the first decoder layers), so the peak covers them at the token budget.
    """
    tables = [[0] * -(-n // shape.block_size) for n in seq_lens]  # every entry: the one block
    metadata = attention_backend.build_metadata(
        seq_lens, seq_lens, tables, shape.block_size, device
    )
    num_tokens = sum(seq_lens)
    positions = torch.cat([torch.arange(n, device=device) for n in seq_lens])
    positions = positions.unsqueeze(0).expand(3, -1)  # [3, num_tokens]: text positions
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    width, dtype = mm_rows
    mm_embeds = torch.zeros(num_tokens, width, dtype=dtype, device=device)  # [num_tokens, width]
    mm_index = torch.arange(num_tokens, device=device)  # [num_tokens]
    embeds = model.embed_input_ids(input_ids, mm_embeds, mm_index)  # [num_tokens, hidden]
    hidden = model(None, positions, metadata, kv_caches, inputs_embeds=embeds)
    num_rows = min(shape.max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[-num_rows:])  # [num_rows, vocab]
    # as in a step: the forward's embeddings are gone, its hidden states live through sampling
    del embeds
    _run_sampler(logits, shape.max_logprobs, device)
    del mm_embeds
    return num_rows


def _run_sampler(logits: torch.Tensor, max_logprobs: int, device: torch.device) -> None:
    """One sampler pass over every row at `_PROFILE_SAMPLING`: its float32 copy of the logits,
    the sort, the penalties' counts and the logprobs table are all live at its peak."""
    params = SamplingParams(**_PROFILE_SAMPLING, logprobs=max_logprobs)
    # a short history: the penalties' [num_rows, vocab] counts do not grow with it
    rows = [SamplingRow(f"profile-{i}", params, 0, (), (0, 1)) for i in range(len(logits))]
    sample_step(logits, rows, make_device_generator(0, device), None)
