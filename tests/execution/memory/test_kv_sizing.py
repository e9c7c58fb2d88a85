"""KV sizing by a profile run: the arithmetic, the dummy step's shapes, and the profile run
itself on the CPU with the device's memory readings given (the same code CUDA runs)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from mmserve.execution.memory.device import MemorySnapshot
from mmserve.execution.memory.kv_sizing import (
    CUDA_GRAPH_RESERVE_BYTES,
    GpuProfile,
    profiled_kv_budget,
    size_kv_cache,
)
from mmserve.execution.memory.profile import (
    MemoryFigures,
    ProfileShape,
    encoder_profile_grids,
    lm_profile_seq_lens,
    profile_memory,
)
from mmserve.layers.attention import TorchAttentionBackend
from mmserve.models.loader import load_model
from tests.support.deepstack import with_deepstack_levels

GIB, MIB = 1 << 30, 1 << 20


def _figures(**overrides: int) -> MemoryFigures:
    values = {
        "total_bytes": 80 * GIB,
        "free_bytes": 60 * GIB,
        "weights_bytes": 16 * GIB,
        "activation_peak_bytes": 3 * GIB,
        "non_torch_bytes": 1 * GIB,
    }
    values.update(overrides)
    return MemoryFigures(**values, encoder_grids=((1, 2, 2),), lm_seq_lens=(8,), num_sampled_rows=8)


def test_the_kv_cache_gets_utilization_times_total_less_every_other_figure() -> None:
    sizing = size_kv_cache(
        _figures(),
        utilization=0.9,
        bytes_per_block=MIB,
        encoder_cache_bytes=512 * MIB,
        input_buffer_bytes=128 * MIB,
        cuda_graph_reserve_bytes=256 * MIB,
    )
    # 72 GiB - 16 - 3 - 1 - 0.5 - 0.125 - 0.25 = 51.125 GiB
    assert sizing.num_blocks == 51 * 1024 + 128
    assert sizing.kv_cache_bytes == sizing.num_blocks * MIB
    assert not sizing.is_limited_by_free_memory
    text = sizing.describe()
    for figure in ("0.90 x 81920 MiB total", "weights 16384 MiB", "activation peak 3072 MiB"):
        assert figure in text
    assert "52352 blocks = 52352 MiB" in text and "CUDA graph reserve 256 MiB" in text
    assert "input buffers 128.0 MiB" in text


def test_never_more_than_is_free_when_another_process_holds_memory() -> None:
    sizing = size_kv_cache(
        _figures(free_bytes=20 * GIB),  # another process took 40 GiB
        utilization=0.9,
        bytes_per_block=3 * MIB,
        encoder_cache_bytes=0,
        input_buffer_bytes=GIB,
        cuda_graph_reserve_bytes=GIB,
    )
    assert sizing.is_limited_by_free_memory
    # less what is still to come: activations, input buffers, graph reserve
    assert sizing.num_blocks == (20 - 3 - 1 - 1) * GIB // (3 * MIB)
    assert "limited by free memory" in sizing.describe()


def test_no_block_left_fails_start_up_saying_what_to_lower() -> None:
    with pytest.raises(ValueError) as excinfo:
        size_kv_cache(
            _figures(activation_peak_bytes=60 * GIB),
            utilization=0.9,
            bytes_per_block=MIB,
            encoder_cache_bytes=0,
            input_buffer_bytes=0,
            cuda_graph_reserve_bytes=0,
        )
    message = str(excinfo.value)
    flags = ("--max-num-batched-tokens", "--max-model-len", "--max-num-seqs")
    for flag in (*flags, "--gpu-memory-utilization"):
        assert flag in message
    assert "activation peak 61440 MiB" in message


@pytest.mark.parametrize(
    ("max_patches", "max_item_tokens"), [(16384 * 4, 16384), (8192 * 4, 3000), (4 * 7, 5)]
)
def test_the_encoder_runs_grids_that_exist_and_fill_its_budget(max_patches, max_item_tokens):
    grids = encoder_profile_grids(max_patches, max_item_tokens, merge=2)
    tokens = [t * h * w // 4 for t, h, w in grids]
    budget_tokens = max_patches // 4
    assert all(t == 1 and h % 2 == 0 and w % 2 == 0 for t, h, w in grids)
    assert all(0 < n <= max_item_tokens for n in tokens)
    assert all(max(h, w) / min(h, w) < 200 for _, h, w in grids)  # smart_resize's limit
    # a near-square grid may drop a few of an item's tokens, fewer than one row of them
    assert 0 <= budget_tokens - sum(tokens) < len(grids) * math.isqrt(max_item_tokens)


def test_the_lm_runs_the_token_budget_as_prefills_no_longer_than_the_model() -> None:
    assert lm_profile_seq_lens(8192, 32768) == [8192]
    assert lm_profile_seq_lens(8192, 3000) == [3000, 3000, 2192]
    assert lm_profile_seq_lens(6000, 3000) == [3000, 3000]


class RecordedMemory:
    """A `DeviceMemory` whose readings are given (the CPU has no allocator statistics); it
    records every call, so a test sees what the profile run read and when."""

    def __init__(self, allocated: list[int], peak: int, snapshot: MemorySnapshot) -> None:
        self.allocated = list(allocated)
        self.peak = peak
        self.snapshot_after = snapshot
        self.events: list[str] = []

    def snapshot(self) -> MemorySnapshot:
        self.events.append("snapshot")
        return self.snapshot_after

    def allocated_bytes(self) -> int:
        self.events.append("allocated")
        return self.allocated.pop(0)

    def reset_peak(self) -> None:
        self.events.append("reset_peak")

    def peak_allocated_bytes(self) -> int:
        self.events.append("peak")
        return self.peak

    def synchronize(self) -> None:
        self.events.append("synchronize")

    def empty_cache(self) -> None:
        self.events.append("empty_cache")


class SamplerOps(TorchFunctionMode):
    """Records the sampler's costly calls, with their shapes, into the profile's event list."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("sort", "log_softmax", "topk"):
            shape = list(args[0].shape)
            k = f" k={args[1]}" if name == "topk" else ""
            self.events.append(f"{name} {shape}{k}")
        return func(*args, **kwargs)


def _gpu_profile(checkpoint: Path, events: list[str], at_start: MemorySnapshot) -> GpuProfile:
    model, config = load_model(checkpoint, dtype=torch.float32)
    # Hooks (not stand-ins): the real towers run, and say when.
    model.visual.register_forward_hook(lambda *_: events.append("vit"))
    model.model.register_forward_hook(lambda *_: events.append("lm"))
    shape = ProfileShape(
        max_num_batched_tokens=40,
        max_num_seqs=4,
        max_model_len=24,
        max_patches_per_call=4 * 20,
        max_tokens_per_mm_item=12,
        block_size=16,
        max_logprobs=5,
    )
    return GpuProfile(
        model, config, TorchAttentionBackend(), shape, at_start, torch.device("cpu"), torch.float32
    )


def test_the_profile_run_reads_the_peak_of_the_vit_and_the_lm_at_their_budgets(
    tiny_checkpoint: Path,
) -> None:
    at_start = MemorySnapshot(free_bytes=70 * GIB, total_bytes=80 * GIB, reserved_bytes=0)
    after = MemorySnapshot(free_bytes=50 * GIB, total_bytes=80 * GIB, reserved_bytes=19 * GIB)
    memory = RecordedMemory([16 * GIB, 16 * GIB + MIB], peak=20 * GIB, snapshot=after)
    gpu = _gpu_profile(tiny_checkpoint, memory.events, at_start)
    with SamplerOps(memory.events):
        figures = profile_memory(
            gpu.model,
            gpu.model_config,
            gpu.attention_backend,
            gpu.shape,
            memory,
            at_start,
            device=gpu.device,
            dtype=gpu.dtype,
        )
    vocab = gpu.model_config.vocab_size
    assert memory.events == [
        "synchronize",
        "allocated",  # the weights
        "allocated",  # with the one-block dummy KV cache: the peak is measured above it
        "reset_peak",
        "vit",
        "lm",
        # the sampler over max_num_seqs rows, inside the peak's window: logprobs at
        # --max-logprobs, then top-k and the top-p sort over the whole vocabulary
        f"log_softmax [4, {vocab}]",
        f"topk [4, {vocab}] k=5",
        f"topk [4, {vocab}] k=50",
        f"sort [4, {vocab}]",
        "synchronize",
        "peak",
        "empty_cache",
        "snapshot",
    ]
    assert figures.weights_bytes == 16 * GIB
    assert figures.activation_peak_bytes == 4 * GIB - MIB
    # 30 GiB used at the end, 19 of them torch's; 10 GiB were used (not torch's) at start
    assert figures.non_torch_bytes == 1 * GIB
    assert (figures.free_bytes, figures.total_bytes) == (50 * GIB, 80 * GIB)
    assert figures.encoder_grids == ((1, 6, 8), (1, 4, 8))  # 12 + 8 tokens: the 20-token budget
    assert figures.lm_seq_lens == (24, 16)
    assert figures.num_sampled_rows == 4


class SpliceRecorder:
    """The tiny model as a DeepStack model meets the profile run: it takes encoder rows
    hidden x (1 + levels) wide and splices the main embedding (each row's first `hidden`
    values); it records the rows it was given."""

    def __init__(self, model: torch.nn.Module, hidden: int) -> None:
        self.model = model
        self.hidden = hidden
        self.rows: list[tuple[tuple[int, ...], torch.dtype, list[int]]] = []

    def embed_multimodal(self, pixels, grids):
        return self.model.embed_multimodal(pixels, grids)

    def embed_input_ids(self, input_ids, mm_embeds=None, mm_index=None):
        self.rows.append((tuple(mm_embeds.shape), mm_embeds.dtype, mm_index.tolist()))
        return self.model.embed_input_ids(input_ids, mm_embeds[:, : self.hidden], mm_index)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


@pytest.mark.parametrize("levels", [0, 2])
def test_the_lm_profile_splices_rows_of_every_deepstack_level(qwen2_vl_dir: Path, levels) -> None:
    """A step's gathered encoder rows live through its forward: the profile run gives the model
    one row per token at the full row width (hidden x (1 + levels)), so its peak holds them."""
    at_start = MemorySnapshot(free_bytes=70 * GIB, total_bytes=80 * GIB, reserved_bytes=0)
    after = MemorySnapshot(free_bytes=50 * GIB, total_bytes=80 * GIB, reserved_bytes=19 * GIB)
    memory = RecordedMemory([16 * GIB, 16 * GIB + MIB], peak=20 * GIB, snapshot=after)
    gpu = _gpu_profile(qwen2_vl_dir, memory.events, at_start)
    config = with_deepstack_levels(gpu.model_config, levels)
    model = SpliceRecorder(gpu.model, config.hidden_size)
    profile_memory(
        model,
        config,
        gpu.attention_backend,
        gpu.shape,
        memory,
        at_start,
        device=gpu.device,
        dtype=gpu.dtype,
    )
    num_tokens = gpu.shape.max_num_batched_tokens
    width = config.hidden_size * (1 + levels)
    assert model.rows == [((num_tokens, width), torch.float32, list(range(num_tokens)))]


def test_profiled_budget_logs_each_figure(qwen2_vl_dir: Path, caplog) -> None:
    at_start = MemorySnapshot(free_bytes=79 * GIB, total_bytes=80 * GIB, reserved_bytes=0)
    after = MemorySnapshot(free_bytes=60 * GIB, total_bytes=80 * GIB, reserved_bytes=18 * GIB)
    memory = RecordedMemory([16 * GIB, 16 * GIB], peak=18 * GIB, snapshot=after)
    gpu = _gpu_profile(qwen2_vl_dir, memory.events, at_start)
    with caplog.at_level(logging.INFO, logger="mmserve.execution.memory.kv_sizing"):
        kv_bytes = profiled_kv_budget(
            gpu,
            memory,
            utilization=0.5,
            bytes_per_block=MIB,
            encoder_cache_bytes=GIB,
            input_buffer_bytes=64 * MIB,
            has_cuda_graphs=True,
            has_encoder_cuda_graphs=True,
        )
    # 40 GiB - weights 16 - peak 2 - non-torch 1 - encoder cache 1 - buffers - graph reserve
    assert kv_bytes == 20 * GIB - 64 * MIB - CUDA_GRAPH_RESERVE_BYTES
    log = caplog.text
    assert "activation peak 2048 MiB" in log and "0.50 x 81920 MiB total" in log
    assert "LM over 24+16 new tokens" in log
    assert "sampler (top-k, top-p, penalties, 5 logprobs) on 4 rows" in log
    assert "encoder CUDA graphs: captured lazily in one shared pool" in log
    assert "input buffers 64.0 MiB" in log


def test_kv_cache_memory_is_vllms_other_name_for_the_bytes_flag() -> None:
    from tests.support.config_args import args_of

    assert args_of("--kv-cache-memory", "4096").kv_cache_memory_bytes == 4096
    assert args_of("--kv-cache-memory-bytes", "8192").kv_cache_memory_bytes == 8192
    assert args_of().kv_cache_memory_bytes is None
