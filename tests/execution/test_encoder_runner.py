"""EncoderRunner: read-only pixel arrays (wire frames) are encoded in place: no copy, no warning."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from mmserve.execution.encoder_runner import EncoderRunner
from mmserve.multimodal import MultiModalFeature, PlaceholderRange, ProcessedImage


def _feature(identifier: str, pixels: np.ndarray) -> MultiModalFeature:
    data = ProcessedImage(pixels, (1, 2, 2))
    return MultiModalFeature(identifier, "image", PlaceholderRange(0, 1), data, (1, 2, 2))


def test_a_read_only_array_is_encoded_in_place_without_a_warning():
    seen: list[torch.Tensor] = []

    def embed(pixels: torch.Tensor, grids):
        seen.append(pixels)
        return [pixels.sum(dim=0, keepdim=True)]

    runner = EncoderRunner(embed, device=torch.device("cpu"), dtype=torch.float32,
                           max_patches_per_call=16)  # fmt: skip
    frame = np.arange(8, dtype=np.float32).tobytes()  # bytes: what a received frame looks like
    pixels = np.frombuffer(frame, dtype=np.float32).reshape(4, 2)
    assert not pixels.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner.encode([_feature("a" * 64, pixels)])
    assert seen[0].data_ptr() == pixels.ctypes.data  # no copy
    assert torch.equal(runner.get("a" * 64), torch.tensor([[12.0, 16.0]]))
