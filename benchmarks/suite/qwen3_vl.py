"""Qwen3-VL-8B-shaped rows: its vision tower on a 1024x1024 image, its language model's decode.

Both are mmserve's Qwen3-VL classes with random weights at Qwen3-VL-8B-Instruct's shapes:

- the tower (`Qwen3VisionTransformer`): 27 blocks of width 1152, 16 heads of 72, MLP 4304,
  GELU-tanh, patch 16 (a 1024x1024 image is 64x64 patches, 1,024 tokens), the learned position
  table resampled to the grid, and three DeepStack mergers (blocks 8, 16, 24);
- the language model (a Qwen3-VL checkpoint written by the test factory, its vision tower
  tiny): hidden 4096, 36 layers, 32 query heads over 8 KV heads of 128, q/k norms, MLP 12288,
  an untied 151,936-row head, decoded through `LLM` as the 7B rows are.

The decode limit here is the strict one: the bytes a decode step must read (every decoder
weight and the LM head, one embedding row per token) over the measured bandwidth.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from benchmarks.suite.checkpoints import describe_checkpoint
from benchmarks.suite.decode import measure_decode
from benchmarks.suite.profile import Profile
from benchmarks.suite.timing import best_seconds, release_memory
from benchmarks.suite.vit import vit_flops
from tests.support.factory import write_tiny_checkpoint

from mmserve.models.config import VisionConfig, load_model_config
from mmserve.models.qwen3_vl_vision import Qwen3VisionTransformer
from mmserve.processing.image_processor import smart_resize

# Qwen3-VL's processor: shortest_edge 65,536 and longest_edge 16,777,216 pixels.
MIN_PIXELS, MAX_PIXELS = 65536, 16777216


def q3_vision_config(shape: dict[str, Any]) -> VisionConfig:
    return VisionConfig(model_type="qwen3_vl", **shape)


def deepstack_flops(cfg: VisionConfig, num_patches: int) -> int:
    """The DeepStack mergers' matmuls: per merger, 2 (N/4) 4d 4d + 2 (N/4) 4d o (as vit_flops'
    final merger, which with the blocks and the patch embedding is the same for Qwen3-VL)."""
    unit = cfg.spatial_merge_size**2
    rows, width = num_patches // unit, unit * cfg.embed_dim
    per_merger = 2 * rows * width * width + 2 * rows * width * cfg.out_dim
    return len(cfg.deepstack_visual_indexes) * per_merger


def measure_vit_q3(profile: Profile, gemm_tflops: float | None) -> dict[str, Any]:
    cfg = q3_vision_config(profile.q3_vit_shape)
    dtype = getattr(torch, profile.dtype)
    with torch.device(profile.device):
        tower = Qwen3VisionTransformer(cfg).to(dtype).eval()
    width, height = profile.q3_vit_image
    factor = cfg.patch_size * cfg.spatial_merge_size
    h, w = smart_resize(height, width, factor=factor, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    grid = (1, h // cfg.patch_size, w // cfg.patch_size)
    num_patches = grid[1] * grid[2]
    pixels = torch.randn(num_patches, cfg.patch_input_dim, device=profile.device, dtype=dtype)
    with torch.inference_mode():
        shape = list(tower(pixels, [grid]).shape)  # [tokens, out_dim * (1 + levels)]
        seconds = best_seconds(
            lambda tower=tower: tower(pixels, [grid]), profile.vit_repeats, profile.device
        )
    flops = vit_flops(cfg, num_patches)
    flops["deepstack"] = deepstack_flops(cfg, num_patches)
    flops["linear"] += flops["deepstack"]
    flops["total"] += flops["deepstack"]
    row: dict[str, Any] = {
        "image": f"{width}x{height}",
        "resized": f"{w}x{h}",
        "patches": num_patches,
        "tokens": num_patches // cfg.spatial_merge_size**2,
        "output_shape": shape,  # the main embedding and each DeepStack level, side by side
        "ms": seconds * 1e3,
        "flops": flops,
        "tflops": flops["total"] / seconds / 1e12,
        "tflops_linear_only": flops["linear"] / seconds / 1e12,
    }
    if gemm_tflops:
        row["pct_of_gemm_peak"] = 100 * row["tflops"] / gemm_tflops
        row["pct_of_gemm_peak_linear_only"] = 100 * row["tflops_linear_only"] / gemm_tflops
    attention = "varlen" if tower.uses_varlen(profile.device, dtype) else "reference"
    del tower
    release_memory(profile.device)
    fields = ("depth", "embed_dim", "num_heads", "head_dim", "mlp_hidden_dim", "out_dim")
    return {
        "tower": {
            **{k: getattr(cfg, k) for k in fields},
            "patch_size": cfg.patch_size,
            "hidden_act": cfg.hidden_act,
            "deepstack_visual_indexes": list(cfg.deepstack_visual_indexes),
        },
        "dtype": profile.dtype,
        "attention": attention,
        "weights": "random (torch default init)",
        "images": [row],
    }


def decode_q3_section(profile: Profile, work_dir: Path, peaks: dict[str, Any]) -> dict[str, Any]:
    """Write the 8B-shaped checkpoint, decode at each batch size on the device's default
    backend (triton on CUDA), delete the checkpoint (16 GB of disk)."""
    spec = profile.q3_lm
    assert spec is not None and spec.overrides is not None
    path = work_dir / spec.name
    write_tiny_checkpoint(
        path, "qwen3_vl", seed=8, dtype=profile.dtype, device=profile.device, **spec.overrides
    )
    release_memory(profile.device)
    try:
        ckpt = describe_checkpoint(path)
        text = load_model_config(path).text
        gb_per_s = peaks.get("bandwidth", {}).get("gb_per_s")
        limit: dict[str, Any] = {
            "bandwidth_gb_per_s": gb_per_s,
            "lm_bytes_per_decode_step": ckpt["lm_bytes_per_decode_step"],
            "lm_bytes": ckpt["lm_bytes"],
        }
        limit_ms = None
        if gb_per_s:
            limit_ms = ckpt["lm_bytes_per_decode_step"] / (gb_per_s * 1e9) * 1e3
            limit["limit_ms"] = limit_ms
        backend = "triton" if profile.device == "cuda" else "torch"
        run = measure_decode(profile, path, limit_ms, attention_backend=backend)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return {
        "checkpoint": {
            "layers": ckpt["layers"],
            "hidden_size": ckpt["hidden_size"],
            "vocab_size": ckpt["vocab_size"],
            "num_heads": text.num_attention_heads,
            "num_kv_heads": text.num_key_value_heads,
            "head_dim": text.head_dim,
            "weight_bytes": ckpt["weight_bytes"],
        },
        "architecture": "Qwen3VLForConditionalGeneration",
        "weight_read_limit": limit,
        "steps": {"short": profile.decode_steps[0], "long": profile.decode_steps[1]},
        "backends": {backend: run},
    }
