"""The 7B vision tower (Qwen2-VL, random weights) on a 1024x1024 and a 4K image: ms and TFLOP/s."""

from __future__ import annotations

from typing import Any

import torch
from benchmarks.suite.profile import Profile
from benchmarks.suite.timing import best_seconds, release_memory

from mmserve.models.config import VisionConfig
from mmserve.models.qwen2_vl_vision import VisionTransformer
from mmserve.processing.image_processor import smart_resize

MIN_PIXELS, MAX_PIXELS = 56 * 56, 16384 * 28 * 28  # the Qwen2-VL processor defaults


def vit_flops(cfg: VisionConfig, num_patches: int) -> dict[str, int]:
    """Multiply-adds x 2 of one Qwen2-VL ViT forward over one image of N patches.

    With d = embed_dim, m = mlp_hidden_dim, P = C*T*p*p (1176), o = out_dim:
      patch embed      2 N P d
      per block        2 N d (3d + d)        qkv and output projection
                       + 2 N d m * 2         fc1 and fc2
                       + 2 N^2 d * 2         Q K^T and A V over all heads (full attention)
      merger (N/4 rows of width 4d)  2 (N/4) 4d 4d + 2 (N/4) 4d o
    Norms, rotary, softmax and activations are left out (not matmuls, a few % at most).
    """
    n, d, m = num_patches, cfg.embed_dim, cfg.mlp_hidden_dim
    unit = cfg.spatial_merge_size**2
    linear = 2 * n * cfg.patch_input_dim * d
    linear += cfg.depth * (2 * n * d * 4 * d + 2 * 2 * n * d * m)
    linear += 2 * (n // unit) * (unit * d) ** 2 + 2 * (n // unit) * unit * d * cfg.out_dim
    attention = cfg.depth * 2 * 2 * n * n * d
    return {"linear": linear, "attention": attention, "total": linear + attention}


def _config(profile: Profile) -> VisionConfig:
    return VisionConfig(model_type="qwen2_vl", **profile.vit_shape)


def measure_vit(profile: Profile, gemm_tflops: float | None) -> dict[str, Any]:
    cfg = _config(profile)
    dtype = getattr(torch, profile.dtype)
    with torch.device(profile.device):
        tower = VisionTransformer(cfg).to(dtype).eval()
    rows = []
    for width, height in profile.vit_images:
        h, w = smart_resize(height, width, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
        grid = (1, h // cfg.patch_size, w // cfg.patch_size)
        num_patches = grid[1] * grid[2]
        pixels = torch.randn(num_patches, cfg.patch_input_dim, device=profile.device, dtype=dtype)
        with torch.inference_mode():
            seconds = best_seconds(
                lambda pixels=pixels, grid=grid: tower(pixels, [grid]),
                profile.vit_repeats,
                profile.device,
            )
        flops = vit_flops(cfg, num_patches)
        row = {
            "image": f"{width}x{height}",
            "resized": f"{w}x{h}",
            "patches": num_patches,
            "ms": seconds * 1e3,
            "flops": flops,
            "tflops": flops["total"] / seconds / 1e12,
            "tflops_linear_only": flops["linear"] / seconds / 1e12,
        }
        if gemm_tflops:
            row["pct_of_gemm_peak"] = 100 * row["tflops"] / gemm_tflops
            row["pct_of_gemm_peak_linear_only"] = 100 * row["tflops_linear_only"] / gemm_tflops
        rows.append(row)
    release_memory(profile.device)
    return {
        "tower": {
            k: getattr(cfg, k)
            for k in ("depth", "embed_dim", "num_heads", "mlp_hidden_dim", "out_dim")
        },
        "dtype": profile.dtype,
        # varlen (flash over cu_seqlens) wherever it runs: CUDA in half precision
        "attention": "varlen" if tower.uses_varlen(profile.device, dtype) else "reference",
        "weights": "random (torch default init)",
        "images": rows,
    }
