"""Antialiased bicubic resize of uint8 frames, in numpy, as torch resizes uint8 tensors.

transformers' video processor resizes frames with torchvision, whose uint8 path is PyTorch's
separable fixed-point resampler (the Pillow-SIMD algorithm): per axis, each output sample is a
weighted sum of a window of input samples, with the weights normalised, then scaled to int16
at the highest precision that fits, and the sum rounded and clipped back to uint8 after each
pass (width first, then height). Pillow uses the same weights at a fixed 22-bit precision, so
its results differ by one level on ~0.5% of pixels: that is why frames are not resized with
Pillow here (the image path does use Pillow, as transformers' PIL image processor does).

    window of output x:  center = scale * (x + 0.5), support = 2 * max(scale, 1)
                         inputs [int(center - support + 0.5), int(center + support + 0.5))
    weight of input i:   keys_cubic((i - center + 0.5) / max(scale, 1)), a = -0.5
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

_CUBIC_A = -0.5  # Keys' cubic as Pillow and PyTorch's antialiased bicubic use it
_CUBIC_SUPPORT = 2.0
_MAX_PRECISION_BITS = 22  # PyTorch's bound on the int16 weights' fraction bits
_INT16_LIMIT = 1 << 15


class AxisWeights(NamedTuple):
    starts: np.ndarray  # [out] int64: first input index of each output's window
    weights: np.ndarray  # [out, ksize] int64: fixed-point weights, zero past a window's end
    precision_bits: int


def _keys_cubic(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    a = _CUBIC_A
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def axis_weights(in_size: int, out_size: int) -> AxisWeights:
    """The fixed-point resampling weights of one axis (float64 arithmetic, like PyTorch)."""
    scale = in_size / out_size
    support = _CUBIC_SUPPORT * scale if scale >= 1.0 else _CUBIC_SUPPORT
    inv_scale = 1.0 / scale if scale >= 1.0 else 1.0
    ksize = int(np.ceil(support)) * 2 + 1
    centers = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    # int() truncates toward zero, and the values are >= -support + 0.5 > -inf: clamp after
    starts = np.maximum((centers - support + 0.5).astype(np.int64), 0)
    ends = np.minimum((centers + support + 0.5).astype(np.int64), in_size)
    taps = np.arange(ksize)
    inside = taps[None, :] < (ends - starts)[:, None]
    offsets = (starts[:, None] + taps[None, :] - centers[:, None] + 0.5) * inv_scale
    w = np.where(inside, _keys_cubic(offsets), 0.0)
    totals = w.sum(axis=1, keepdims=True)
    w = np.divide(w, totals, out=np.zeros_like(w), where=totals != 0)
    w_max = float(w.max()) if w.size else 0.0
    bits = 0
    while bits < _MAX_PRECISION_BITS and int(0.5 + w_max * (1 << (bits + 1))) < _INT16_LIMIT:
        bits += 1
    scaled = w * (1 << bits)
    fixed = np.where(scaled < 0, (scaled - 0.5).astype(np.int64), (scaled + 0.5).astype(np.int64))
    return AxisWeights(starts, fixed, bits)


def _resample_axis(pixels: np.ndarray, axis: int, out_size: int) -> np.ndarray:
    """One separable pass over `axis` of a uint8 array; returns uint8."""
    in_size = pixels.shape[axis]
    aw = axis_weights(in_size, out_size)
    # int32 as PyTorch: 255 x sum|w| x 2^22 < 2^31 for every cubic window
    moved = np.moveaxis(pixels, axis, -1).astype(np.int32)  # [..., in]
    acc = np.full((*moved.shape[:-1], out_size), 1 << (aw.precision_bits - 1), dtype=np.int32)
    for k in range(aw.weights.shape[1]):
        idx = np.minimum(aw.starts + k, in_size - 1)  # a zero weight past the end reads anything
        acc += moved[..., idx] * aw.weights[:, k].astype(np.int32)
    out = np.clip(acc >> aw.precision_bits, 0, 255).astype(np.uint8)
    return np.moveaxis(out, -1, axis)


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """[T, H, W, C] uint8 -> [T, height, width, C] uint8 (width pass first, as PyTorch)."""
    assert frames.dtype == np.uint8 and frames.ndim == 4, (frames.dtype, frames.shape)
    out = frames
    if frames.shape[2] != width:
        out = _resample_axis(out, 2, width)
    if frames.shape[1] != height:
        out = _resample_axis(out, 1, height)
    return np.ascontiguousarray(out)
