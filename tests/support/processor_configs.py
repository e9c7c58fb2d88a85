"""The processor files of the tiny test checkpoints (preprocessor_config.json and Qwen3-VL's
video_preprocessor_config.json), as the real checkpoints ship them."""

from __future__ import annotations

from typing import Any

_COMMON = {
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def preprocessor_config(min_pixels: int = 56 * 56, max_pixels: int = 16384 * 28 * 28) -> dict:
    """Qwen2-VL's and Qwen2.5-VL's file: patch 14, CLIP mean/std, min/max_pixels."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        **_COMMON,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "patch_size": 14,
        "resample": 3,
    }


def _qwen3_common(min_pixels: int, max_pixels: int) -> dict[str, Any]:
    return {
        "processor_class": "Qwen3VLProcessor",
        **_COMMON,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": 16,
    }


def qwen3_vl_preprocessor_config(min_pixels: int, max_pixels: int) -> dict[str, Any]:
    """Qwen3-VL's image file: patch 16, mean/std 0.5, the pixel caps as `size`."""
    return {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        **_qwen3_common(min_pixels, max_pixels),
        "resample": 3,
    }


def qwen3_vl_video_preprocessor_config(min_pixels: int, max_pixels: int) -> dict[str, Any]:
    """Qwen3-VL's video file: as the image one, `size` over all frames, 2 fps sampling."""
    return {
        "video_processor_type": "Qwen3VLVideoProcessor",
        **_qwen3_common(min_pixels, max_pixels),
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
        "do_sample_frames": True,
    }
