"""The vision tower with encoder CUDA graphs against eager: a 1024x1024 image and a thumbnail batch.

Measured on the tower itself (the profile's ViT shape, random weights) through the engine's own
`EncoderGraphs`, over the ladder the engine builds by default for Qwen2-VL (16384 tokens of
encoder budget = 65536 input patches), so the padding into a power of two is paid as in serving.
Without CUDA (the smoke run) the graph is the eager stand-in the CPU tests use: the code path is
exercised, the figure means nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from benchmarks.suite.profile import Profile
from benchmarks.suite.timing import best_seconds, release_memory
from benchmarks.suite.vit import MAX_PIXELS, MIN_PIXELS

from mmserve.execution.encoder.graphs import (
    EncoderGraphs,
    smallest_budget,
)
from mmserve.execution.graphs.capture import cuda_graph_factory, eager_graph_factory
from mmserve.models.config import VisionConfig
from mmserve.models.qwen2_vl_vision import VisionTransformer
from mmserve.processing.image_processor import smart_resize

DEFAULT_MAX_PATCHES_PER_CALL = 16384 * 4  # the engine's default encoder budget, in patches


def _grid(cfg: VisionConfig, width: int, height: int) -> tuple[int, int, int]:
    h, w = smart_resize(height, width, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return (1, h // cfg.patch_size, w // cfg.patch_size)


def compare_vit_graphs(profile: Profile) -> dict[str, Any]:
    out = _measure(profile)
    release_memory(profile.device)  # the tower, its graphs and their pool are garbage by now
    return out


def _measure(profile: Profile) -> dict[str, Any]:
    cfg = VisionConfig(model_type="qwen2_vl", **profile.vit_shape)
    dtype = getattr(torch, profile.dtype)
    device = torch.device(profile.device)
    with torch.device(device):
        tower = VisionTransformer(cfg).to(dtype).eval()
    on_cuda = device.type == "cuda"
    graphs = EncoderGraphs(
        tower,
        lambda pixels, grids: [tower(pixels, grids)],
        max_patches_per_call=DEFAULT_MAX_PATCHES_PER_CALL,
        device=device,
        dtype=dtype,
        make_graph=cuda_graph_factory(device) if on_cuda else eager_graph_factory,
    )
    width, height = profile.vit_images[0]
    thumb_w, thumb_h = profile.vit_thumbnail
    calls = {
        f"{width}x{height}": [_grid(cfg, width, height)],
        f"{profile.vit_thumbnail_batch}x{thumb_w}x{thumb_h}": [_grid(cfg, thumb_w, thumb_h)]
        * profile.vit_thumbnail_batch,
    }
    rows = []
    with torch.inference_mode():
        for name, grids in calls.items():
            num_patches = sum(t * h * w for t, h, w in grids)
            pixels = torch.randn(num_patches, cfg.patch_input_dim, device=device, dtype=dtype)
            eager_s = best_seconds(
                lambda pixels=pixels, grids=grids: tower(pixels, grids),
                profile.vit_repeats,
                profile.device,
            )
            # the warm-up call captures the budget's graph
            graph_s = best_seconds(
                lambda pixels=pixels, grids=grids: graphs(pixels, grids),
                profile.vit_repeats,
                profile.device,
            )
            diff = (torch.cat(graphs(pixels, grids)) - tower(pixels, grids)).abs().max().item()
            rows.append(
                {
                    "call": name,
                    "patches": num_patches,
                    "budget": smallest_budget(graphs.budgets, num_patches),
                    "eager_ms": eager_s * 1e3,
                    "graph_ms": graph_s * 1e3,
                    "speedup": eager_s / graph_s,
                    "max_abs_diff": diff,
                }
            )
    return {
        "graph": "cuda" if on_cuda else "eager stand-in (no CUDA): not a measurement",
        "attention": "varlen" if tower.uses_varlen(device, dtype) else "reference",
        "dtype": profile.dtype,
        "budgets": list(graphs.budgets),
        "captured": list(graphs.captured_budgets),
        "capture_mib": {b: n / 2**20 for b, n in graphs.capture_bytes.items()},
        "eager_fallbacks": graphs.num_eager_calls,
        "calls": rows,
    }
