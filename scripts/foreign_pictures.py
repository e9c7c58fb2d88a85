"""A second, independent drawing routine for the toy model's questions: the "foreign" set.

The training pictures (scripts/toy_data.py, scripts/toy_render.py) are drawn with Pillow's
polygon and ellipse rasteriser. These are drawn by other code, so that a model that learned
one generator's quirks rather than shapes is caught out:
- geometry: every pixel is tested against the shape in numpy (distance for circles, a turned
  frame for squares, an even-odd crossing test for polygons), 3x3 subpixel samples for smooth
  edges or one sample for hard ones; the triangle is equilateral (the training one is not),
  the star's inner radius is its own, and turns go up to 25 degrees;
- palette jitter in HSV (hue, saturation, value), not per RGB channel;
- backgrounds: the ones people use (white, black, greys, beige, light blue, tinted mid greys),
  random tints, radial gradients, paper grain, diagonal hatching;
- outlines of 1-4 pixels measured in pixels, not as a share of the shape;
- JPEG at quality 55-95 half the time.

Questions and answers are the training set's (same words, same grammar); only the pictures
differ. Every answer is a pure function of the seed.
"""

from __future__ import annotations

import colorsys
import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image
from toy_data import COLOURS, ORDINALS, QUESTIONS, SHAPES, article, position_of

RGB = tuple[int, int, int]
FOREIGN_TASKS = ("describe", "colour", "shape", "position", "which", "same_colour")
NAMED_BACKGROUNDS: dict[str, RGB] = {
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "grey": (128, 128, 128),
    "beige": (240, 230, 200),
    "light blue": (200, 220, 255),
}
BACKGROUND_KINDS = (*NAMED_BACKGROUNDS, "tinted grey", "tint", "radial", "paper", "hatching")


@dataclass(frozen=True)
class ForeignShape:
    kind: str
    colour: str
    rgb: RGB
    cx: float
    cy: float
    size: float  # diameter of the circle the shape fits in, pixels
    turn: float  # degrees


@dataclass(frozen=True)
class ForeignPicture:
    width: int
    height: int
    background: str  # one of BACKGROUND_KINDS
    colours: tuple[RGB, RGB]  # the background's colours (a second one for radial, hatching)
    shape: ForeignShape
    outline: RGB | None
    outline_px: float
    smooth: bool
    jpeg: int | None
    seed: int

    def conditions(self) -> dict[str, str]:
        """What the picture looks like, in words, for per-condition accuracy."""
        share = self.shape.size / min(self.width, self.height)
        return {
            "background": self.background,
            "outline": "outlined" if self.outline else "no outline",
            "edges": "smooth" if self.smooth else "hard",
            "format": "PNG"
            if not self.jpeg
            else "JPEG q55-75"
            if self.jpeg <= 75
            else "JPEG q76-95",
            "turned": "turned" if abs(self.shape.turn) >= 5 else "upright",
            "size": "small (<45%)" if share < 0.45 else "large (>=45%)",
        }


@dataclass(frozen=True)
class ForeignQuestion:
    task: str
    pictures: tuple[ForeignPicture, ...]
    question: str
    answer: str


def _hsv_jitter(rng: np.random.Generator, name: str) -> RGB:
    """The palette colour moved in hue, saturation and value; still nearest its own name."""
    h, s, v = colorsys.rgb_to_hsv(*(c / 255 for c in COLOURS[name]))
    while True:
        hue = (h + rng.uniform(-0.025, 0.025)) % 1.0
        sat = min(1.0, s * rng.uniform(0.85, 1.1))
        val = min(1.0, v * rng.uniform(0.85, 1.08))
        rgb = tuple(round(255 * c) for c in colorsys.hsv_to_rgb(hue, sat, val))
        nearest = min(COLOURS, key=lambda n: math.dist(COLOURS[n], rgb))
        if nearest == name:
            return rgb


def _far(colour: RGB, fills: list[RGB]) -> bool:
    return all(math.dist(colour, f) >= 100 for f in fills)


def _background(rng: np.random.Generator, fills: list[RGB]) -> tuple[str, tuple[RGB, RGB]]:
    while True:
        kind = BACKGROUND_KINDS[rng.integers(len(BACKGROUND_KINDS))]
        if kind in NAMED_BACKGROUNDS:
            first = NAMED_BACKGROUNDS[kind]
        elif kind == "tinted grey":
            first = tuple(int(c) for c in rng.integers(90, 161, size=3))
        else:
            h, s, v = rng.random(), rng.uniform(0.0, 0.6), rng.uniform(0.35, 1.0)
            first = tuple(round(255 * c) for c in colorsys.hsv_to_rgb(h, s, v))
        second = tuple(int(np.clip(c + rng.integers(-70, 71), 0, 255)) for c in first)
        if _far(first, fills) and (kind not in ("radial", "hatching") or _far(second, fills)):
            return kind, (first, second)


def _size(rng: np.random.Generator) -> tuple[int, int]:
    side = int(rng.integers(112, 337))
    if rng.random() < 0.7:
        return side, side
    other = round(side * (0.75 if rng.random() < 0.5 else 4 / 3))
    return side, int(np.clip(other, 112, 336))


def sample_picture(
    rng: np.random.Generator,
    kind: str | None = None,
    colour: str | None = None,
    cell: tuple[int, int] | None = None,
) -> ForeignPicture:
    """One shape; with `cell` (row, col) small enough to sit well inside that 3x3 cell."""
    width, height = _size(rng)
    kind = kind or SHAPES[rng.integers(len(SHAPES))]
    colour = colour or list(COLOURS)[rng.integers(len(COLOURS))]
    rgb = _hsv_jitter(rng, colour)
    short = min(width, height)
    turn = 0.0 if kind == "circle" or rng.random() < 0.5 else rng.uniform(-25, 25)
    if cell is None:
        size = rng.uniform(0.3, 0.8) * short
        cx = rng.uniform(size / 2, width - size / 2)
        cy = rng.uniform(size / 2, height - size / 2)
    else:
        row, col = cell
        size = rng.uniform(0.3, 0.5) * short
        cx = _inside_cell(rng, col, width, size)
        cy = _inside_cell(rng, row, height, size)
    background, colours = _background(rng, [rgb])
    outline = None
    if rng.random() < 0.3:
        outline = [(0, 0, 0), (40, 40, 40), (255, 255, 255)][rng.integers(3)]
    return ForeignPicture(
        width,
        height,
        background,
        colours,
        ForeignShape(kind, colour, rgb, cx, cy, size, turn),
        outline,
        float(rng.uniform(1.0, 4.0)),
        bool(rng.random() < 0.5),
        int(rng.integers(55, 96)) if rng.random() < 0.5 else None,
        int(rng.integers(2**31)),
    )


def _inside_cell(rng: np.random.Generator, cell: int, side: int, size: float) -> float:
    lo = max(size / 2, (cell / 3 + 0.06) * side)
    hi = min(side - size / 2, ((cell + 1) / 3 - 0.06) * side)
    return rng.uniform(lo, hi) if hi > lo else (cell + 0.5) * side / 3


def position_answer(picture: ForeignPicture) -> str:
    """The training set's rule (the cell holding the centre), on this routine's shape."""
    return position_of(picture.shape, picture.width, picture.height)


def sample_question(rng: np.random.Generator, task: str) -> ForeignQuestion:
    if task in ("describe", "colour", "shape"):
        pic = sample_picture(rng)
        s = pic.shape
        answer = {
            "describe": f"{article(s.colour)} {s.colour} {s.kind}",
            "colour": s.colour,
            "shape": s.kind,
        }[task]
        return ForeignQuestion(task, (pic,), QUESTIONS[task], answer)
    if task == "position":
        cell = (int(rng.integers(3)), int(rng.integers(3)))
        pic = sample_picture(rng, cell=cell)
        return ForeignQuestion(task, (pic,), QUESTIONS[task], position_answer(pic))
    if task == "which":
        kinds = rng.choice(len(SHAPES), size=2, replace=False)
        pics = tuple(sample_picture(rng, kind=SHAPES[k]) for k in kinds)
        target = int(rng.integers(2))
        question = QUESTIONS[task].format(shape=SHAPES[kinds[target]])
        return ForeignQuestion(task, pics, question, ORDINALS[target])
    if task == "same_colour":
        same = bool(rng.random() < 0.5)
        names = [list(COLOURS)[c] for c in rng.choice(len(COLOURS), size=2, replace=False)]
        first = sample_picture(rng, colour=names[0])
        second = sample_picture(rng, colour=names[0] if same else names[1])
        return ForeignQuestion(task, (first, second), QUESTIONS[task], "yes" if same else "no")
    raise ValueError(f"unknown foreign task {task!r}; expected one of {FOREIGN_TASKS}")


def questions(task: str, num: int, seed: int) -> list[ForeignQuestion]:
    rng = np.random.default_rng([seed, FOREIGN_TASKS.index(task)])
    return [sample_question(rng, task) for _ in range(num)]


# --- drawing ---------------------------------------------------------------------------------


def _polygon(kind: str, size: float) -> np.ndarray | None:
    """Corners [N, 2] around (0, 0) before turning; None for a circle."""
    r = size / 2
    if kind == "circle":
        return None
    if kind == "square":
        h = 0.4 * size  # a side of 0.8 of the size: a little smaller than the circle
        return np.array([[-h, -h], [h, -h], [h, h], [-h, h]])
    if kind == "triangle":  # equilateral, centred on its centroid
        angles = np.radians([-90, 30, 150])
    else:  # a five-pointed star, inner radius 0.4 of the outer
        angles = np.radians(np.arange(10) * 36 - 90)
    radii = np.where(np.arange(len(angles)) % 2 == 0, r, 0.4 * r) if kind == "star" else r
    return np.stack([radii * np.cos(angles), radii * np.sin(angles)], axis=1)


def _inside(points: np.ndarray | None, x: np.ndarray, y: np.ndarray, r: float) -> np.ndarray:
    """Even-odd crossing test of each (x, y) against the polygon; a disc when points is None."""
    if points is None:
        return x * x + y * y <= r * r
    inside = np.zeros(x.shape, bool)
    n = len(points)
    for i in range(n):
        (x0, y0), (x1, y1) = points[i], points[(i + 1) % n]
        crosses = (y0 > y) != (y1 > y)
        with np.errstate(divide="ignore", invalid="ignore"):
            at = x0 + (y - y0) * (x1 - x0) / (y1 - y0)
        inside ^= crosses & (x < at)
    return inside


def _coverage(picture: ForeignPicture, grow: float) -> np.ndarray:
    """[H, W] share of each pixel inside the shape grown by `grow` pixels (negative: shrunk)."""
    s = picture.shape
    offsets = (np.arange(3) + 0.5) / 3 if picture.smooth else np.array([0.5])
    ys, xs = np.mgrid[0 : picture.height, 0 : picture.width].astype(np.float64)
    scale = (s.size + 2 * grow) / s.size
    points = _polygon(s.kind, s.size)
    if points is not None:
        points = points * scale
    turn = math.radians(s.turn)
    cos, sin = math.cos(turn), math.sin(turn)
    total = np.zeros(xs.shape)
    for dy in offsets:
        for dx in offsets:
            u, v = xs + dx - s.cx, ys + dy - s.cy
            # Into the shape's own frame: turn the sample points the other way.
            x, y = cos * u + sin * v, -sin * u + cos * v
            total += _inside(points, x, y, s.size / 2 * scale)
    return total / len(offsets) ** 2


def _background_pixels(picture: ForeignPicture) -> np.ndarray:
    rng = np.random.default_rng(picture.seed)
    h, w = picture.height, picture.width
    first, second = (np.array(c, np.float64) for c in picture.colours)
    out = np.broadcast_to(first, (h, w, 3)).copy()
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float64)
    if picture.background == "radial":
        d = np.hypot(xs - rng.uniform(0, w), ys - rng.uniform(0, h))
        t = (d / d.max())[..., None]
        out = (1 - t) * first + t * second
    elif picture.background == "paper":
        out += rng.uniform(-10, 10, size=(h, w, 1))
    elif picture.background == "hatching":
        spacing = rng.uniform(6, 16)
        lines = ((xs + ys) % spacing) < 1.5
        out[lines] = second
    return out


def draw_foreign(picture: ForeignPicture) -> Image.Image:
    pixels = _background_pixels(picture)
    layers = [(picture.shape.rgb, 0.0)]
    if picture.outline is not None:
        layers = [(picture.outline, 0.0), (picture.shape.rgb, -picture.outline_px)]
    for rgb, grow in layers:
        cover = _coverage(picture, grow)[..., None]
        pixels = pixels * (1 - cover) + np.array(rgb, np.float64) * cover
    image = Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8), "RGB")
    if picture.jpeg is None:
        return image
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=picture.jpeg)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
