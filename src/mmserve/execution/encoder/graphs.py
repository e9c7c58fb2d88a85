"""CUDA graphs for the vision tower: a ladder of budgets in input patches, pad, replay, clone.

A small image through a 32-block ViT is a few hundred kernel launches of little work each:
launch-bound. Replaying a captured graph removes the launches. A call of n patches is padded
into the smallest budget b >= n of the ladder:

    budgets:   floor, 2 floor, 4 floor, ... (powers of two), max_patches_per_call
    call:      | real patches (n) | padding (b - n): segments of their own, outputs dropped |

The floor is 256 input patches: a 224x224 image (16 x 16 patches of 14 px), 64 tokens after
the 2x2 merge, the smallest budget vLLM captures for Qwen2.5-VL. Below it a call's cost is the
launches alone, the same for every size, so smaller budgets would only add graphs.

Graphs are captured lazily, the first time a budget is needed: a server only ever holds the
graphs of the sizes its traffic has (a typical one sees a few), start-up stays as fast as
eager, and no graph is captured for a budget that never comes. All graphs share one memory
pool: replays are serial and every output is cloned out of the graph's static buffer before
the next replay, so the pool only needs the largest graph's activations, not their sum. A call
that does not fit (more patches than the largest budget, or more frames than a budget has
segments for) runs eagerly.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mmserve.execution.graphs.capture import CapturedGraph, GraphFactory, cuda_graph_factory
from mmserve.grid import grid_num_patches, grid_num_tokens
from mmserve.layers.attention.vision import VisionAttentionMetadata
from mmserve.models.qwen2_vl_vision import VisionTransformer
from mmserve.models.vision_metadata import (
    PaddedShape,
    build_vision_metadata,
    check_vision_inputs,
)

logger = logging.getLogger(__name__)

GRAPH_FLOOR_PATCHES = 256  # a 224x224 image: 64 tokens after the 2x2 merge
# Frame segments a budget's graph has room for (+1 for the padding). The full-attention
# kernel's grid is segments x ceil(max_seqlen / 128) x heads with max_seqlen = the budget, so
# every slot costs launch width whether used or not; 64 images of one call is a thumbnail batch.
MAX_GRAPH_FRAMES = 64

EmbedFn = Callable[[torch.Tensor, list[tuple[int, int, int]]], list[torch.Tensor]]


def graph_budgets(max_patches: int, floor: int = GRAPH_FLOOR_PATCHES) -> tuple[int, ...]:
    """Powers of two from `floor` below `max_patches`, then `max_patches` itself (so every call
    the encoder budget admits has a graph); just `max_patches` when it is below the floor."""
    if max_patches < 1 or floor < 1:
        raise ValueError(
            f"budgets need max_patches >= 1 and floor >= 1, got {max_patches}, {floor}"
        )
    budgets = []
    size = floor
    while size < max_patches:
        budgets.append(size)
        size *= 2
    return (*budgets, max_patches)


def smallest_budget(budgets: Sequence[int], num_patches: int) -> int | None:
    """The smallest budget that holds `num_patches`, or None (the call runs eagerly)."""
    return next((b for b in budgets if b >= num_patches), None)


def padded_shape(budget: int, merge_unit: int) -> PaddedShape:
    return PaddedShape(budget, min(budget // merge_unit, MAX_GRAPH_FRAMES + 1))


@dataclass(frozen=True)
class _BudgetGraph:
    shape: PaddedShape
    pixels: torch.Tensor  # [budget, C*T*P*P] static input
    meta_buffers: tuple[torch.Tensor, ...]  # static metadata tensors, refilled per call
    graph: CapturedGraph  # output [budget / merge_unit, out_dim]


class EncoderGraphs:
    """An `EmbedFn` (what `EncoderRunner` calls) that replays a graph per budget, else `eager`."""

    def __init__(
        self,
        tower: VisionTransformer,
        eager: EmbedFn,
        *,
        max_patches_per_call: int,
        device: torch.device,
        dtype: torch.dtype,
        make_graph: GraphFactory,
        floor_patches: int = GRAPH_FLOOR_PATCHES,
    ) -> None:
        self._tower = tower
        self._eager = eager
        self._device = device
        self._dtype = dtype
        self._make_graph = make_graph
        self._merge_size = tower.config.spatial_merge_size
        self._merge_unit = self._merge_size**2
        self.budgets = graph_budgets(max_patches_per_call, floor_patches)
        if any(b % self._merge_unit for b in self.budgets):
            raise ValueError(
                f"encoder graph budgets {self.budgets} must be multiples of {self._merge_unit} "
                "patches (whole 2x2 groups)"
            )
        self._graphs: dict[int, _BudgetGraph] = {}
        # device memory reserved by each capture (its static buffers and pool growth); 0 on CPU
        self.capture_bytes: dict[int, int] = {}
        self.num_replays = 0
        self.num_eager_calls = 0

    @property
    def captured_budgets(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def __call__(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        grids = check_vision_inputs(pixel_values, grid_thw, self._tower.config)
        num_patches = pixel_values.shape[0]
        budget = smallest_budget(self.budgets, num_patches)
        if budget is None or not self._fits(grids, budget):
            self.num_eager_calls += 1
            return self._eager(pixel_values, grids)
        entry = self._graphs.get(budget) or self._capture(budget)
        # [budget, 2] positions, cu_seqlens, window index: built here, copied into the graph's
        meta = build_vision_metadata(grids, self._tower.config, "cpu", padded=entry.shape)
        entry.pixels[:num_patches].copy_(pixel_values.to(self._dtype), non_blocking=True)
        entry.pixels[num_patches:].zero_()
        for static, fresh in zip(entry.meta_buffers, _tensors(meta), strict=True):
            static.copy_(fresh, non_blocking=True)
        entry.graph.replay()
        self.num_replays += 1
        # Cloned: the next replay of this graph, or of another in the shared pool, reuses it.
        merged = entry.graph.output[: num_patches // self._merge_unit].clone()
        return list(merged.split([grid_num_tokens(grid, self._merge_size) for grid in grids]))

    def _fits(self, grids: list[tuple[int, int, int]], budget: int) -> bool:
        num_frames = sum(t for t, _, _ in grids)
        has_padding = sum(grid_num_patches(grid) for grid in grids) < budget
        return num_frames + has_padding <= padded_shape(budget, self._merge_unit).num_frame_segments

    def _capture(self, budget: int) -> _BudgetGraph:
        start = time.perf_counter()
        reserved_before = _reserved_bytes(self._device)
        shape = padded_shape(budget, self._merge_unit)
        cfg = self._tower.config
        # Captured over one 2x2 frame and padding; every call refills the same buffers.
        merge = cfg.spatial_merge_size
        meta = self._tower.build_metadata([(1, merge, merge)], self._device, padded=shape)
        meta = _without_host_copies(meta)
        pixels = torch.zeros(budget, cfg.patch_input_dim, device=self._device, dtype=self._dtype)
        graph = self._make_graph(lambda: self._tower.encode(pixels, meta))
        self._graphs[budget] = _BudgetGraph(shape, pixels, _tensors(meta), graph)
        self.capture_bytes[budget] = _reserved_bytes(self._device) - reserved_before
        logger.info(
            "encoder CUDA graph for %d patches captured in %.2f s, +%d MiB reserved "
            "(%d graphs held)",
            budget,
            time.perf_counter() - start,
            self.capture_bytes[budget] >> 20,
            len(self._graphs),
        )
        return self._graphs[budget]


def _reserved_bytes(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def _tensors(meta: VisionAttentionMetadata) -> tuple[torch.Tensor, ...]:
    """The metadata's tensors in a fixed order (the windowed layout once when it is `full`)."""
    out = [meta.positions, meta.full.cu_seqlens]
    if meta.windowed is not meta.full:
        out.append(meta.windowed.cu_seqlens)
    if meta.window_index is not None:
        out += [meta.window_index, meta.window_inverse]
    return tuple(out)


def _without_host_copies(meta: VisionAttentionMetadata) -> VisionAttentionMetadata:
    """Static metadata: segment lengths only in `cu_seqlens` (refilled per call)."""
    full = dataclasses.replace(meta.full, seqlens=None)
    windowed = (
        full if meta.windowed is meta.full else dataclasses.replace(meta.windowed, seqlens=None)
    )
    return dataclasses.replace(meta, full=full, windowed=windowed)


def make_encoder_embed(
    model: torch.nn.Module,
    *,
    enable_encoder_cuda_graph: bool,
    enforce_eager: bool,
    device: torch.device,
    dtype: torch.dtype,
    max_patches_per_call: int,
) -> tuple[EmbedFn, bool]:
    """The encoder's `EmbedFn` and whether it replays graphs (`--enable-encoder-cuda-graph`).

    Refused where graphs cannot run (`ValueError` naming the flag); `--enforce-eager` wins.
    """
    eager: EmbedFn = model.embed_multimodal
    if not enable_encoder_cuda_graph:
        return eager, False
    if enforce_eager:
        logger.info("--enforce-eager: the vision encoder runs eagerly (no encoder CUDA graphs)")
        return eager, False
    if not isinstance(model.visual, VisionTransformer):
        raise ValueError(
            "--enable-encoder-cuda-graph supports the Qwen2-VL and Qwen2.5-VL vision towers, "
            f"not {type(model.visual).__name__}. Drop the flag."
        )
    if device.type != "cuda":
        raise ValueError(
            f"--enable-encoder-cuda-graph needs a CUDA device; the engine runs on {device}. "
            "Drop the flag (or run on a GPU)."
        )
    tower: VisionTransformer = model.visual
    if not tower.uses_varlen(device, dtype):
        raise ValueError(
            "--enable-encoder-cuda-graph needs the varlen vision attention: --dtype bfloat16 or "
            f"float16 (got {dtype}) and a torch with torch.nn.attention.varlen "
            f"(this is {torch.__version__}). Drop the flag or change the dtype."
        )
    graphs = EncoderGraphs(
        tower,
        eager,
        max_patches_per_call=max_patches_per_call,
        device=device,
        dtype=dtype,
        make_graph=cuda_graph_factory(device),
    )
    logger.info(
        "encoder CUDA graphs: budgets %s input patches, captured on first use", graphs.budgets
    )
    return graphs, True
