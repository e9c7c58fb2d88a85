"""Image processor: the seed's token table, parity with transformers' PIL processor, overrides."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from PIL import Image

from mmserve.errors import InvalidRequestError
from mmserve.processing.image_processor import (
    ImageProcessorConfig,
    get_grid_thw,
    get_num_image_tokens,
    max_tokens_per_item,
    process_image,
    smart_resize,
)
from tests.support.factory import random_image

QWEN2_VL_7B = ImageProcessorConfig(min_pixels=56 * 56, max_pixels=16384 * 28 * 28)


def _hf_processor(cfg: ImageProcessorConfig):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)


def _hf_smart_resize(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf

    return hf(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)


@pytest.mark.parametrize(
    ("width", "height", "tokens"),
    [(336, 336, 144), (1024, 1024, 1369), (3840, 2160, 10549), (1920, 1080, 2691)],
)
def test_seed_token_table(width: int, height: int, tokens: int) -> None:
    assert get_num_image_tokens(width, height, QWEN2_VL_7B) == tokens


def test_seed_token_table_rows_follow_the_formula() -> None:
    # 1920x1080 -> round to 1932x1092 (69 x 39 merged tokens), under the cap: no rescale.
    assert smart_resize(1080, 1920, min_pixels=3136, max_pixels=16384 * 784) == (1092, 1932)
    assert smart_resize(1024, 1024, min_pixels=3136, max_pixels=16384 * 784) == (1036, 1036)
    assert sum(get_num_image_tokens(1024, 1024, QWEN2_VL_7B) for _ in range(8)) == 10952


def test_aspect_ratio_over_200_is_refused_with_a_clear_error() -> None:
    with pytest.raises(InvalidRequestError, match="aspect ratio"):
        get_num_image_tokens(201, 1, QWEN2_VL_7B)
    assert get_num_image_tokens(200, 1, QWEN2_VL_7B) > 0


def _parity_sizes() -> list[tuple[int, int]]:
    rng = np.random.default_rng(1234)
    sizes = [(1, 1), (28, 5000), (5000, 28), (4000, 3000), (14, 14), (15, 15)]
    # around every rounding boundary of the first branch (k*28 +- 14) and of the caps
    for k in (1, 2, 3, 10):
        for d in (-1, 0, 1):
            sizes.append((k * 28 + 14 + d, 57))
            sizes.append((83, k * 28 + 14 + d))
    sizes += [(56, 56), (55, 57), (112, 28), (113, 27)]  # around min_pixels = 3136
    while len(sizes) < 110:
        w, h = (int(v) for v in rng.integers(14, 700, size=2))
        if max(w, h) / min(w, h) <= 200:
            sizes.append((w, h))
    return sizes


def _diverges_from_transformers(width: int, height: int, cfg: ImageProcessorConfig) -> bool:
    """Where the seed's max(factor, round(...)) and transformers' bare round(...) can differ."""
    return min(width, height) < cfg.factor // 2


@pytest.mark.parametrize("cfg", [QWEN2_VL_7B, ImageProcessorConfig(max_pixels=1280 * 784)])
def test_parity_with_transformers_pil_processor(cfg: ImageProcessorConfig) -> None:
    hf = _hf_processor(cfg)
    checked = 0
    for i, (w, h) in enumerate(_parity_sizes()):
        if _diverges_from_transformers(w, h, cfg):
            continue
        image = random_image(w, h, seed=i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = hf(image, return_tensors="np")
        ours = process_image(image, cfg)
        assert ours.grid_thw == tuple(int(v) for v in ref["image_grid_thw"][0]), (w, h)
        assert ours.pixel_values.dtype == np.uint8  # levels; the engine normalises them
        np.testing.assert_array_equal(ours.normalized(), ref["pixel_values"])  # bit for bit
        assert get_num_image_tokens(w, h, cfg) * 4 == ours.num_patches
        checked += 1
    assert checked >= 100


def test_parity_for_rgba_and_grayscale_inputs() -> None:
    hf = _hf_processor(QWEN2_VL_7B)
    for mode in ("RGBA", "L"):
        image = random_image(97, 61, seed=3, mode=mode)
        ref = hf(image, return_tensors="np")
        ours = process_image(image, QWEN2_VL_7B)
        np.testing.assert_array_equal(ours.normalized(), ref["pixel_values"])


def test_smart_resize_agrees_with_transformers_except_documented_sides_under_14px() -> None:
    rng = np.random.default_rng(7)
    for _ in range(3000):
        w, h = (int(v) for v in rng.integers(1, 3000, size=2))
        if max(w, h) / min(w, h) > 200:
            continue
        ours = smart_resize(h, w, min_pixels=3136, max_pixels=16384 * 784)
        if not _diverges_from_transformers(w, h, QWEN2_VL_7B):
            assert ours == _hf_smart_resize(h, w, QWEN2_VL_7B), (w, h)
    # The documented divergence: a 10 px side rounds to 0 in transformers, to 28 in the seed.
    assert smart_resize(10, 200, min_pixels=3136, max_pixels=16384 * 784) == (28, 196)
    assert _hf_smart_resize(10, 200, QWEN2_VL_7B) == (28, 252)
    # Tiny images are upscaled the same way by both.
    assert smart_resize(1, 1, min_pixels=3136, max_pixels=16384 * 784) == (56, 56)
    assert _hf_smart_resize(1, 1, QWEN2_VL_7B) == (56, 56)


def test_small_max_pixels_never_gives_a_zero_side() -> None:
    cfg = ImageProcessorConfig(min_pixels=784, max_pixels=784 * 4)
    assert min(get_grid_thw(4000, 20, cfg)[1:]) >= 2


def test_max_tokens_per_item_bounds_every_image_and_is_tight() -> None:
    rng = np.random.default_rng(3)
    for cfg in (QWEN2_VL_7B, ImageProcessorConfig(min_pixels=784, max_pixels=784 * 16)):
        bound = max_tokens_per_item(cfg)
        worst = 0
        for _ in range(2000):
            w = int(rng.integers(1, 20000))
            h = max(1, int(w / rng.uniform(1 / 200, 200)))
            if max(w, h) / min(w, h) > 200:
                continue
            worst = max(worst, get_num_image_tokens(w, h, cfg))
        assert worst <= bound
    assert max_tokens_per_item(QWEN2_VL_7B) == 16384
    assert get_num_image_tokens(3584, 3584, QWEN2_VL_7B) == 16384  # 128 x 28 square: attained


def test_from_pretrained_reads_the_checkpoint_not_class_defaults(tmp_path) -> None:
    raw = {"min_pixels": 3136, "max_pixels": 16384 * 784, "patch_size": 14, "merge_size": 2}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(raw))
    assert ImageProcessorConfig.from_pretrained(tmp_path).max_pixels == 16384 * 784
    raw = {"size": {"shortest_edge": 1000, "longest_edge": 5000}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(raw))
    cfg = ImageProcessorConfig.from_pretrained(tmp_path)
    assert (cfg.min_pixels, cfg.max_pixels) == (1000, 5000)


def test_overrides_accept_only_min_and_max_pixels() -> None:
    cfg = QWEN2_VL_7B.with_overrides({"max_pixels": 512 * 784})
    assert cfg.max_pixels == 512 * 784 and cfg.min_pixels == QWEN2_VL_7B.min_pixels
    assert get_num_image_tokens(3840, 2160, cfg) <= 512
    with pytest.raises(InvalidRequestError, match="patch_size"):
        QWEN2_VL_7B.with_overrides({"patch_size": 16})
    with pytest.raises(InvalidRequestError, match="positive integer"):
        QWEN2_VL_7B.with_overrides({"max_pixels": "big"})
    with pytest.raises(InvalidRequestError, match="must not exceed"):
        QWEN2_VL_7B.with_overrides({"min_pixels": 10**9})


def test_processed_patch_layout_matches_a_constant_image() -> None:
    # A flat colour must give the same normalised value in every column of its channel.
    image = Image.new("RGB", (56, 84), (255, 0, 128))
    out = process_image(image, QWEN2_VL_7B)
    assert out.pixel_values.shape == (out.num_patches, 3 * 2 * 14 * 14)
    assert out.pixel_values.dtype == np.uint8
    levels = out.pixel_values.reshape(out.num_patches, 3, -1)
    assert (levels[:, 0] == 255).all() and (levels[:, 1] == 0).all() and (levels[:, 2] == 128).all()
    per_channel = out.normalized().reshape(out.num_patches, 3, -1)
    expected = (np.array([1.0, 0.0, 128 / 255]) - np.array(QWEN2_VL_7B.image_mean)) / np.array(
        QWEN2_VL_7B.image_std
    )
    np.testing.assert_allclose(per_channel[0, :, 0], expected, atol=1e-5)
    assert np.ptp(per_channel, axis=(0, 2)).max() < 1e-6
