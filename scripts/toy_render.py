"""How the toy generator's pictures look: backgrounds, outlines, anti-aliasing, rotation, JPEG.

A `Style` is drawn once per picture from the seeded stream (`sample_style`) and stored in it, so
`toy_data.draw` stays a pure function of the `Picture`. The defaults (`PLAIN`) reproduce the
first checkpoint's pictures: a flat background, hard-edged solid shapes, PNG.

What a style may vary, and what it keeps true:
- the background is any colour (greys, tints, pastels, saturated colours), flat or a linear
  gradient, with light noise or a faint texture; every colour in it stays at least
  `MIN_CONTRAST` (RGB distance) from every shape's colour, so a shape never melts into it;
- a shape may have an outline (dark, light, or a darker shade of its fill) no wider than
  `MAX_OUTLINE` of its size, so its fill stays most of it;
- edges are anti-aliased (4x supersampled coverage) or hard;
- the picture may be saved as JPEG at quality 60-95 and read back.
A shape's fill colour is never changed by any of these, so its name stays truthful.
"""

from __future__ import annotations

import colorsys
import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

RGB = tuple[int, int, int]

# No background colour comes closer than this (Euclidean RGB) to a shape's fill.
MIN_CONTRAST = 110.0
# An outline is at most this share of the shape's radius wide.
MAX_OUTLINE = 0.12
SUPERSAMPLE = 4
BACKGROUNDS = ("plain", "gradient", "noise", "texture")
BACKGROUND_SHARES = (0.45, 0.25, 0.15, 0.15)


@dataclass(frozen=True)
class Style:
    background: str = "plain"  # one of BACKGROUNDS
    colours: tuple[RGB, ...] = ()  # the background's colours; () uses Picture.background
    angle: float = 0.0  # gradient direction, radians
    amount: float = 0.0  # noise sigma or texture amplitude, levels
    period: float = 8.0  # texture period, pixels
    seed: int = 0  # for noise and texture
    outline: RGB | None = None
    outline_width: float = 0.0  # share of each shape's radius
    antialias: bool = False
    jpeg_quality: int | None = None  # None: PNG (lossless)


PLAIN = Style()


def distance(a: RGB, b: RGB) -> float:
    return math.dist(a, b)


def contrasts(colour: RGB, fills: tuple[RGB, ...]) -> bool:
    return all(distance(colour, f) >= MIN_CONTRAST for f in fills)


def _hsv(h: float, s: float, v: float) -> RGB:
    return tuple(round(255 * c) for c in colorsys.hsv_to_rgb(h, s, v))


def sample_background_colour(rng: np.random.Generator, fills: tuple[RGB, ...]) -> RGB:
    """Any colour, far enough from every fill: greys, white and black, tints and pastels
    (beige, light blue, tinted mid greys), and saturated colours."""
    while True:
        kind = rng.random()
        if kind < 0.3:
            grey = int(rng.integers(0, 256))
            colour = (grey, grey, grey)
        elif kind < 0.65:
            colour = _hsv(rng.random(), rng.uniform(0.03, 0.35), rng.uniform(0.3, 1.0))
        else:
            colour = _hsv(rng.random(), rng.uniform(0.35, 1.0), rng.uniform(0.2, 1.0))
        if contrasts(colour, fills):
            return colour


def sample_style(rng: np.random.Generator, fills: tuple[RGB, ...]) -> tuple[RGB, Style]:
    """The picture's base background colour and its style, for shapes filled with `fills`."""
    base = sample_background_colour(rng, fills)
    background = BACKGROUNDS[rng.choice(len(BACKGROUNDS), p=BACKGROUND_SHARES)]
    colours: tuple[RGB, ...] = (base,)
    amount = period = angle = 0.0
    if background == "gradient":
        colours = (base, sample_background_colour(rng, fills))
        angle = rng.uniform(0, 2 * math.pi)
    elif background == "noise":
        amount = rng.uniform(3, 14)
    elif background == "texture":
        amount, period = rng.uniform(6, 22), rng.uniform(4, 24)
        angle = rng.uniform(0, math.pi)
    outline, width = None, 0.0
    if rng.random() < 0.35:
        width = rng.uniform(0.04, MAX_OUTLINE)
        pick = rng.random()
        fill = fills[0]
        if pick < 0.45:
            outline = tuple(int(v) for v in rng.integers(0, 50, size=3))
        elif pick < 0.65:
            outline = tuple(int(v) for v in rng.integers(215, 256, size=3))
        else:
            outline = tuple(round(c * rng.uniform(0.35, 0.6)) for c in fill)
    jpeg = int(rng.integers(60, 96)) if rng.random() < 0.4 else None
    style = Style(
        background,
        colours,
        angle,
        amount,
        period,
        int(rng.integers(2**31)),
        outline,
        width,
        bool(rng.random() < 0.6),
        jpeg,
    )
    return base, style


def background_pixels(width: int, height: int, base: RGB, style: Style) -> np.ndarray:
    """[H, W, 3] float32 levels."""
    colours = style.colours or (base,)
    out = np.empty((height, width, 3), np.float32)
    out[:] = np.asarray(colours[0], np.float32)
    if style.background in ("gradient", "texture"):
        ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    if style.background == "gradient":
        u = math.cos(style.angle) * xs + math.sin(style.angle) * ys
        t = ((u - u.min()) / max(float(np.ptp(u)), 1.0))[..., None]
        out = (1 - t) * out + t * np.asarray(colours[1], np.float32)
    elif style.background == "noise":
        rng = np.random.default_rng(style.seed)
        out += rng.normal(0, style.amount, size=(height, width, 1)).astype(np.float32)
    elif style.background == "texture":
        u = math.cos(style.angle) * xs + math.sin(style.angle) * ys
        wave = np.sign(np.sin(2 * math.pi * u / style.period))
        if style.seed % 2:  # checks rather than stripes
            v = -math.sin(style.angle) * xs + math.cos(style.angle) * ys
            wave = wave * np.sign(np.sin(2 * math.pi * v / style.period))
        out += (0.5 * style.amount * wave)[..., None]
    return out


def mask(
    width: int, height: int, kind: str, geometry: tuple | list, antialias: bool
) -> tuple[tuple[slice, slice], np.ndarray]:
    """Where one shape (an ellipse box or a polygon) lies, as rows and columns of the picture,
    and its [rows, cols] float32 coverage in [0, 1] there."""
    xs = geometry[0::2] if kind == "ellipse" else [x for x, _ in geometry]
    ys = geometry[1::2] if kind == "ellipse" else [y for _, y in geometry]
    x0, y0 = max(0, math.floor(min(xs)) - 1), max(0, math.floor(min(ys)) - 1)
    x1, y1 = min(width, math.ceil(max(xs)) + 2), min(height, math.ceil(max(ys)) + 2)
    scale = SUPERSAMPLE if antialias else 1
    canvas = Image.new("L", ((x1 - x0) * scale, (y1 - y0) * scale), 0)
    pen = ImageDraw.Draw(canvas)
    if kind == "ellipse":
        left, top, right, bottom = geometry
        box = ((left - x0) * scale, (top - y0) * scale, (right - x0) * scale, (bottom - y0) * scale)
        pen.ellipse(box, fill=255)
    else:
        pen.polygon([((x - x0) * scale, (y - y0) * scale) for x, y in geometry], fill=255)
    if antialias:
        canvas = canvas.reduce(SUPERSAMPLE)
    return (slice(y0, y1), slice(x0, x1)), np.asarray(canvas, np.float32) * (1 / 255)


def finish(pixels: np.ndarray, style: Style) -> Image.Image:
    """Levels to an 8-bit RGB image, through JPEG when the style says so."""
    image = Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8), "RGB")
    if style.jpeg_quality is None:
        return image
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=style.jpeg_quality)
    buf.seek(0)
    return Image.open(buf).convert("RGB")
