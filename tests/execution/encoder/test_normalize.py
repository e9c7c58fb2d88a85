"""PixelNormalizer: uint8 levels to the tower's floats on the device, exactly the processors'
float32 values (images and videos use different float orders in transformers)."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
import torch

from mmserve.execution.encoder.normalize import PixelNormalizer
from mmserve.multimodal import EncoderInput, PixelNormalization
from mmserve.processing.image_processor import ImageProcessorConfig, process_image
from mmserve.processing.video_processor import VideoMeta, plan_video, process_video
from mmserve.processing.video_sampling import VideoConfig
from tests.support.factory import random_image, video_frames

QWEN3 = ImageProcessorConfig(patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)


def _video(cfg: ImageProcessorConfig) -> EncoderInput:
    frames = video_frames(4, 64, 48, seed=2)
    plan = plan_video(VideoMeta(64, 48, 4, 2.0, is_sampled=True), VideoConfig(), cfg)
    return process_video(frames, plan, cfg)


@pytest.mark.parametrize("cfg", [ImageProcessorConfig(), QWEN3], ids=["clip", "half"])
def test_a_mixed_batch_normalises_each_item_by_its_own_arithmetic(cfg) -> None:
    image, video = process_image(random_image(90, 70, seed=1), cfg), _video(cfg)
    assert image.normalization.order != video.normalization.order
    normalize = PixelNormalizer(torch.device("cpu"), torch.float32)
    out = normalize([image, video, image])  # [rows of all three, patch_dim]
    want = np.concatenate([image.normalized(), video.normalized(), image.normalized()])
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.from_numpy(want))


def test_items_longer_than_a_chunk_and_a_reused_workspace_give_the_same_values(monkeypatch) -> None:
    """The CPU gathers in blocks of CHUNK_ROWS into a workspace kept between calls: a block
    boundary inside an item, and a smaller call after a larger one, change no value."""
    import mmserve.execution.encoder.normalize as normalize_module

    monkeypatch.setattr(normalize_module, "CHUNK_ROWS", 7)  # items of 20-ish rows: many blocks
    cfg = ImageProcessorConfig()
    big, small, video = (
        process_image(random_image(90, 70, seed=1), cfg),
        process_image(random_image(40, 30, seed=5), cfg),
        _video(cfg),
    )
    reused = PixelNormalizer(torch.device("cpu"), torch.float32, reuse_output=True)
    fresh = PixelNormalizer(torch.device("cpu"), torch.float32)
    for batch in ([big, video, small], [small], [video, big]):
        want = torch.from_numpy(np.concatenate([item.normalized() for item in batch]))
        out = reused(batch)
        assert torch.equal(out, want)
        assert torch.equal(fresh(batch), want)
    first = reused([big, video])
    assert reused([small]).data_ptr() == first.data_ptr()  # the workspace, not a new tensor


def test_the_two_orders_differ_somewhere_so_the_order_matters() -> None:
    """transformers rounds images and videos differently; a shared table would change one."""
    cfg = ImageProcessorConfig()
    image_table = cfg.image_normalization.value_table()
    video_table = cfg.video_normalization.value_table()
    assert not np.array_equal(image_table, video_table)
    np.testing.assert_allclose(image_table, video_table, rtol=0, atol=1e-6)


def test_half_precision_output_is_the_float32_value_rounded_once() -> None:
    image = process_image(random_image(60, 60, seed=3), ImageProcessorConfig())
    out = PixelNormalizer(torch.device("cpu"), torch.bfloat16)([image])
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.from_numpy(image.normalized()).to(torch.bfloat16))


def test_rescale_and_normalise_switched_off_give_the_levels() -> None:
    cfg = ImageProcessorConfig(do_rescale=False, do_normalize=False)
    image = process_image(random_image(40, 40, seed=4), cfg)
    out = PixelNormalizer(torch.device("cpu"), torch.float32)([image])
    assert torch.equal(out, torch.from_numpy(image.pixel_values.astype(np.float32)))


def test_bad_normalisations_are_refused_by_name() -> None:
    def make(**changes) -> PixelNormalization:
        fields = msgspec.structs.asdict(ImageProcessorConfig().image_normalization)
        return PixelNormalization(**{**fields, **changes})

    with pytest.raises(ValueError, match="normalization order 'sideways'"):
        make(order="sideways")
    with pytest.raises(ValueError, match="no zero std"):
        make(std=(0.5, 0.0, 0.5))
    with pytest.raises(ValueError, match="finite"):
        make(mean=(float("nan"), 0.5, 0.5))
    raw = msgspec.msgpack.encode(make())
    with pytest.raises(msgspec.ValidationError, match="rescale_then_normalise"):
        msgspec.msgpack.decode(raw.replace(b"rescale_then_normalize", b"rescale_then_normalise"),
                               type=PixelNormalization)  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_on_cuda_the_levels_cross_as_uint8_and_normalise_on_the_device() -> None:
    image = process_image(random_image(448, 448, seed=5), ImageProcessorConfig())
    out = PixelNormalizer(torch.device("cuda"), torch.float32)([image])
    assert out.device.type == "cuda"
    assert torch.equal(out.cpu(), torch.from_numpy(image.normalized()))


@pytest.mark.parametrize(
    "norm",
    [
        ImageProcessorConfig().image_normalization,
        ImageProcessorConfig().video_normalization,
        QWEN3.image_normalization,
        ImageProcessorConfig(do_rescale=False, do_normalize=False).image_normalization,
    ],
    ids=["clip-image", "clip-video", "half", "levels"],
)
def test_the_checkpoints_normalisations_take_the_exact_arithmetic_route(norm) -> None:
    """float32 operations in place of the table's gather (~6x cheaper on a CPU), used only
    because they give the table's value for every level in every column."""
    normalize = PixelNormalizer(torch.device("cpu"), torch.float32)
    assert normalize._form(norm, 3 * 2 * 14 * 14) is not None
    assert PixelNormalizer(torch.device("cpu"), torch.bfloat16)._form(norm, 1176) is None


def test_a_form_one_value_off_is_refused_for_the_table(monkeypatch) -> None:
    import mmserve.execution.encoder.normalize as normalize_module

    real = normalize_module._candidate_forms

    def off_by_an_ulp(norm, channel):
        forms = real(norm, channel)
        return [dataclasses.replace(f, std=torch.nextafter(f.std, f.std + 1)) for f in forms]

    monkeypatch.setattr(normalize_module, "_candidate_forms", off_by_an_ulp)
    image = process_image(random_image(60, 60, seed=3), ImageProcessorConfig())
    normalize = PixelNormalizer(torch.device("cpu"), torch.float32)
    assert torch.equal(normalize([image]), torch.from_numpy(image.normalized()))
    assert normalize._form(image.normalization, image.pixel_values.shape[1]) is None
