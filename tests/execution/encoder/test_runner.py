"""EncoderRunner: uint8 levels normalised on the device exactly as transformers' processors
would, one call per modality, per-modality counts."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from mmserve.execution.encoder.cache import EncoderCache
from mmserve.execution.encoder.runner import EncodeJob, EncoderRunner
from mmserve.metrics import EngineMetrics
from mmserve.multimodal import EncoderInput, MultiModalFeature, PlaceholderRange
from tests.support.factory import CLIP_NORMALIZATION, CLIP_VIDEO_NORMALIZATION, uint8_patches


def _feature(identifier: str, pixels: np.ndarray) -> EncodeJob:
    data = EncoderInput(pixels, (1, 2, 2), CLIP_NORMALIZATION)
    return EncodeJob(
        MultiModalFeature(identifier, "image", PlaceholderRange(0, 1), (1, 2, 2)), data
    )


def test_read_only_levels_reach_the_tower_normalised_bit_for_bit_without_a_warning():
    seen: list[torch.Tensor] = []

    def embed(pixels: torch.Tensor, grids):
        seen.append(pixels)
        return [pixels.sum(dim=0, keepdim=True)]

    runner = EncoderRunner(embed, EncoderCache(torch.device("cpu"), torch.float32),
                           max_patches_per_call=16)  # fmt: skip
    frame = uint8_patches(4, 6, seed=5).tobytes()  # bytes: what a received frame looks like
    pixels = np.frombuffer(frame, dtype=np.uint8).reshape(4, 6)
    assert not pixels.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner.encode([_feature("a" * 64, pixels)])
    want = CLIP_NORMALIZATION.apply(pixels)  # [4, 6] float32: the processor's values
    assert seen[0].dtype == torch.float32
    assert torch.equal(seen[0], torch.from_numpy(want))
    assert torch.equal(runner.cache.get("a" * 64), torch.from_numpy(want).sum(0, keepdim=True))


def _item(identifier: str, modality: str, grid: tuple[int, int, int], seed: int):
    t, h, w = grid
    pixels = uint8_patches(t * h * w, 3, seed)
    if modality == "video":
        data = EncoderInput(pixels, grid, CLIP_VIDEO_NORMALIZATION, 1.0)
    else:
        data = EncoderInput(pixels, grid, CLIP_NORMALIZATION)
    feature = MultiModalFeature(identifier, modality, PlaceholderRange(0, t * h * w // 4), grid)
    return EncodeJob(feature, data)


def test_an_image_video_image_step_is_two_calls_scattered_back_by_identity():
    """One call per modality: both images packed in one, the video in the other; each item's
    embeddings are the ones it gets encoded alone."""
    calls: list[list[tuple[int, int, int]]] = []

    def embed(pixels: torch.Tensor, grids):
        calls.append(list(grids))
        out, start = [], 0
        for t, h, w in grids:  # merge 2x2 neighbours: mean of each run of 4 patch rows
            n = t * h * w
            out.append(pixels[start : start + n].view(n // 4, 4, -1).mean(dim=1))
            start += n
        return out

    metrics = EngineMetrics()
    runner = EncoderRunner(embed, EncoderCache(torch.device("cpu"), torch.float32),
                           max_patches_per_call=1000, metrics=metrics)  # fmt: skip
    items = [
        _item("i" * 64, "image", (1, 4, 6), 1),
        _item("v" * 64, "video", (2, 4, 4), 2),
        _item("j" * 64, "image", (1, 2, 2), 3),
    ]
    runner.encode(items)
    assert calls == [[(1, 4, 6), (1, 2, 2)], [(2, 4, 4)]]
    for item in items:
        pixels = torch.from_numpy(item.pixels.normalized())
        (alone,) = embed(pixels, [item.feature.grid_thw])
        assert torch.equal(runner.cache.get(item.feature.identifier), alone), item.feature.modality
    assert runner.cache.num_bytes == (6 + 8 + 1) * 3 * 4  # embeddings x width x float32
    snap = metrics.snapshot()
    assert snap.counters["encoder_forward_calls"] == 2
    assert snap.modality_counters["encoder_forward_calls"] == {"image": 1, "video": 1}
    assert snap.modality_counters["encoder_items_encoded"] == {"image": 2, "video": 1}
