"""Qwen2-VL image processor in numpy/Pillow: smart_resize, bicubic resize, patchify to uint8.

The rescale and normalisation are not applied here: the patches stay uint8 levels (a quarter
of float32's bytes) and carry the checkpoint's `PixelNormalization`, which the engine applies
on the device before the first vision layer (bit-identical to transformers' float32 values).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmserve.errors import InvalidRequestError
from mmserve.grid import grid_num_tokens
from mmserve.multimodal import EncoderInput, NormalizationOrder, PixelNormalization

MAX_ASPECT_RATIO = 200
# Per-request (and server-wide) overridable keys; everything else is fixed by the checkpoint.
OVERRIDABLE_KEYS = ("min_pixels", "max_pixels")
# transformers' class defaults, used only when preprocessor_config.json does not say.
_HF_DEFAULT_MIN_PIXELS = 56 * 56
_HF_DEFAULT_MAX_PIXELS = 28 * 28 * 1280
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Everything that decides how an image becomes patches (read from preprocessor_config.json)."""

    min_pixels: int = _HF_DEFAULT_MIN_PIXELS
    max_pixels: int = _HF_DEFAULT_MAX_PIXELS
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = _CLIP_MEAN
    image_std: tuple[float, float, float] = _CLIP_STD
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = int(Image.Resampling.BICUBIC)

    def __post_init__(self) -> None:
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"min_pixels ({self.min_pixels}) must not exceed max_pixels ({self.max_pixels})"
            )
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std must have 3 entries (one per RGB channel)")
        if any(s == 0 for s in self.image_std):
            raise ValueError(f"image_std must not contain zeros, got {self.image_std}")

    @property
    def factor(self) -> int:
        """Side multiple of a resized image: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ImageProcessorConfig:
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            raise ValueError(f"{path} not found: a Qwen2-VL checkpoint must ship it")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ImageProcessorConfig:
        # Like transformers: explicit min_pixels/max_pixels win over size.{shortest,longest}_edge.
        size = raw.get("size") or {}
        min_pixels = raw.get("min_pixels") or size.get("shortest_edge") or _HF_DEFAULT_MIN_PIXELS
        max_pixels = raw.get("max_pixels") or size.get("longest_edge") or _HF_DEFAULT_MAX_PIXELS
        kwargs: dict[str, Any] = {"min_pixels": int(min_pixels), "max_pixels": int(max_pixels)}
        for name in ("patch_size", "temporal_patch_size", "merge_size", "resample"):
            if raw.get(name) is not None:
                kwargs[name] = int(raw[name])
        for name in ("do_rescale", "do_normalize"):
            if raw.get(name) is not None:
                kwargs[name] = bool(raw[name])
        if raw.get("rescale_factor") is not None:
            kwargs["rescale_factor"] = float(raw["rescale_factor"])
        for name in ("image_mean", "image_std"):
            if raw.get(name) is not None:
                kwargs[name] = tuple(float(v) for v in raw[name])
        return cls(**kwargs)

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> ImageProcessorConfig:
        """Apply mm_processor_kwargs (server-wide or per request): only min/max_pixels."""
        if not overrides:
            return self
        if not isinstance(overrides, Mapping):
            raise InvalidRequestError(
                'mm_processor_kwargs must be an object such as {"max_pixels": 1003520}',
                param="mm_processor_kwargs",
            )
        unknown = sorted(str(k) for k in overrides if k not in OVERRIDABLE_KEYS)
        if unknown:
            raise InvalidRequestError(
                f"mm_processor_kwargs: unsupported key(s) {unknown}; only {list(OVERRIDABLE_KEYS)} "
                "can be set per request",
                param="mm_processor_kwargs",
            )
        for key, value in overrides.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidRequestError(
                    f"mm_processor_kwargs.{key} must be a positive integer, got {value!r}",
                    param="mm_processor_kwargs",
                )
        new_min = overrides.get("min_pixels", self.min_pixels)
        new_max = overrides.get("max_pixels", self.max_pixels)
        if new_min > new_max:
            raise InvalidRequestError(
                f"mm_processor_kwargs: min_pixels ({new_min}) must not exceed max_pixels "
                f"({new_max})",
                param="mm_processor_kwargs",
            )
        return replace(self, min_pixels=new_min, max_pixels=new_max)

    @cached_property
    def image_normalization(self) -> PixelNormalization:
        """This checkpoint's rescale and normalisation in transformers' image arithmetic (one
        value per config, shared by every image it processes)."""
        return self._normalization("rescale_then_normalize")

    @cached_property
    def video_normalization(self) -> PixelNormalization:
        """The same values in transformers' video arithmetic (see `PixelNormalization`)."""
        return self._normalization("normalize_scaled")

    def _normalization(self, order: NormalizationOrder) -> PixelNormalization:
        mean, std = self.image_mean, self.image_std
        return PixelNormalization(
            (mean[0], mean[1], mean[2]),
            (std[0], std[1], std[2]),
            self.rescale_factor,
            self.do_rescale,
            self.do_normalize,
            order,
        )

    def fingerprint(self) -> tuple[str | int, ...]:
        """The fields that change pixel values for a given resized size (identity input).

        min/max_pixels are left out on purpose: they act only through the resized size, which
        identity covers separately, so a cap that changes nothing for an image changes no id.
        """
        parts: list[str | int] = []
        for f in fields(self):
            if f.name in OVERRIDABLE_KEYS:
                continue
            parts += [f.name, repr(getattr(self, f.name))]
        return tuple(parts)


def smart_resize(
    height: int, width: int, *, factor: int = 28, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The size (height, width) an image is resized to: sides multiples of `factor`, area capped.

    This is the seed's rule (round each side to a multiple of factor, at least one factor; if the
    area is over max_pixels scale down and floor, if under min_pixels scale up and ceil). Unlike
    the seed, the floor branch is clamped at one factor, as transformers does, so that a very
    elongated image under a small max_pixels never gets a zero side.

    Intentional difference from transformers: its first branch has no max(factor, ...), so a
    side under factor/2 pixels rounds to 0 there and always falls to the min_pixels branch. The
    two agree except for images with a side shorter than 14 px whose other side is long enough
    that factor x (rounded long side) already reaches min_pixels (e.g. 10x200: seed 28x196,
    transformers 28x252).
    """
    if height <= 0 or width <= 0:
        raise InvalidRequestError(f"image has an empty side ({width}x{height} pixels)")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidRequestError(
            f"image aspect ratio {max(height, width) / min(height, width):.1f} "
            f"({width}x{height} pixels) is over the limit of {MAX_ASPECT_RATIO}; "
            "crop or pad the image"
        )
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def get_grid_thw(width: int, height: int, cfg: ImageProcessorConfig) -> tuple[int, int, int]:
    """(grid_t, grid_h, grid_w) in patches of an image of this size, without processing it."""
    resized_h, resized_w = smart_resize(
        height, width, factor=cfg.factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels
    )
    return 1, resized_h // cfg.patch_size, resized_w // cfg.patch_size


def get_num_image_tokens(width: int, height: int, cfg: ImageProcessorConfig) -> int:
    """Placeholder tokens (= encoder embeddings) of an image of this size."""
    return grid_num_tokens(get_grid_thw(width, height, cfg), cfg.merge_size)


def max_tokens_per_item(cfg: ImageProcessorConfig) -> int:
    """An upper bound on the tokens of any one image under cfg, tight for real configurations.

    Three ways to reach the largest output (see smart_resize): the rounded or floored area
    stays at or under max_pixels; a side clamped at one factor (only when max_pixels is below
    factor^2 x 200, for a 200:1 image); or the min_pixels branch, whose ceilings add at most
    one factor to each side.
    """
    f2 = cfg.factor**2
    bound = cfg.max_pixels // f2
    if cfg.max_pixels < f2 * MAX_ASPECT_RATIO:
        bound = max(bound, math.floor(math.sqrt(MAX_ASPECT_RATIO * cfg.max_pixels) / cfg.factor))
    m = cfg.min_pixels / f2
    spread = math.sqrt(MAX_ASPECT_RATIO) + 1 / math.sqrt(MAX_ASPECT_RATIO)
    return max(bound, math.floor(m + math.sqrt(m) * spread + 1))


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB view of an image; transparency is composited on white (as transformers does)."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def process_image(image: Image.Image, cfg: ImageProcessorConfig) -> EncoderInput:
    """Resize and patchify one image into uint8 levels (normalised later, on the engine side).

    Output rows follow the merge order the vision tower expects (2x2 merge blocks contiguous)
    and each row is [C, T, P, P] flattened, the single frame repeated T times.

    Each channel is resized on its own (Pillow's uint8 arithmetic is per channel, so this is
    bit-identical to resizing the RGB image, as transformers' PIL backend does) and, for large
    images, the three channels run on three threads: Pillow and numpy release the GIL.
    """
    rgb = to_rgb(image)
    width, height = rgb.size
    _, grid_h, grid_w = get_grid_thw(width, height, cfg)
    p, t = cfg.patch_size, cfg.temporal_patch_size
    out = np.empty((grid_h * grid_w, 3, t, p * p), dtype=np.uint8)  # [N, C, T, P*P]

    def fill(c: int, channel: Image.Image) -> None:
        _fill_channel(out, c, channel, (grid_h, grid_w), cfg)

    channels = rgb.split()
    if grid_h * grid_w * p * p < _PARALLEL_MIN_PIXELS:
        for c, channel in enumerate(channels):
            fill(c, channel)
    else:
        with ThreadPoolExecutor(max_workers=3) as pool:
            for future in [pool.submit(fill, c, ch) for c, ch in enumerate(channels)]:
                future.result()
    return EncoderInput(
        pixel_values=out.reshape(grid_h * grid_w, 3 * t * p * p),
        grid_thw=(1, grid_h, grid_w),
        normalization=cfg.image_normalization,
    )


# Below ~0.5 MP thread start-up costs more than the resize it would overlap.
_PARALLEL_MIN_PIXELS = 512 * 512


def _fill_channel(
    out: np.ndarray,
    c: int,
    channel: Image.Image,
    grid_hw: tuple[int, int],
    cfg: ImageProcessorConfig,
) -> None:
    """Resize one uint8 channel, then patchify it into `out[:, c]` (every temporal slot).

    The copy reads the pixels through a transposed view, so patchifying costs no pass of its
    own beyond the one copy into the output.
    """
    grid_h, grid_w = grid_hw
    p, m = cfg.patch_size, cfg.merge_size
    resized = channel.resize((grid_w * p, grid_h * p), resample=Image.Resampling(cfg.resample))
    pixels = np.asarray(resized)  # [H, W] uint8
    blocks = pixels.reshape(grid_h // m, m, p, grid_w // m, m, p)
    blocks = blocks.transpose(0, 3, 1, 4, 2, 5)  # [gh/m, gw/m, m, m, P, P] view
    out[:, c] = blocks.reshape(grid_h * grid_w, 1, p * p)  # the one frame, repeated over T
