"""The processed-pixel values test items carry: the checkpoints' normalisations and random uint8
patches (an item's pixels as the API process ships them)."""

from __future__ import annotations

import msgspec
import numpy as np

from mmserve.multimodal import PixelNormalization

# What test items carry: the CLIP normalisation of Qwen2-VL checkpoints, in transformers' image
# arithmetic (the engine turns their uint8 levels into floats with it).
CLIP_NORMALIZATION = PixelNormalization(
    (0.48145466, 0.4578275, 0.40821073),
    (0.26862954, 0.26130258, 0.27577711),
    1 / 255,
    True,
    True,
    "rescale_then_normalize",
)
# The same values in transformers' video arithmetic.
CLIP_VIDEO_NORMALIZATION = msgspec.structs.replace(CLIP_NORMALIZATION, order="normalize_scaled")
# Neither rescale nor normalise: the tower reads each level as its float (tests that follow
# values through a fake tower).
LEVELS_AS_FLOATS = msgspec.structs.replace(CLIP_NORMALIZATION, do_rescale=False, do_normalize=False)


def uint8_patches(num_patches: int, patch_dim: int, seed: int = 0) -> np.ndarray:
    """[num_patches, patch_dim] random uint8 levels: an item's processed pixels."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(num_patches, patch_dim), dtype=np.uint8)
