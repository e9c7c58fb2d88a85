"""Synthetic pictures and questions for the bundled toy model: sampling, drawing, chat prompts.

Everything here is a pure function of a `numpy.random.Generator`, so a seed fixes the whole
stream. Pictures hold one or two shapes in distinct colours, slightly rotated or not, on a
background of any colour with or without a gradient, noise or texture, with or without
outlines, anti-aliased or not, PNG or JPEG (`toy_render`); each `Example` pairs one or two
pictures with a question and its exact answer string.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, replace
from functools import lru_cache

import jinja2
import numpy as np
from PIL import Image

try:
    import toy_render
except ModuleNotFoundError:  # imported as scripts.toy_data (the tests, the GPU smoke run)
    from scripts import toy_render

PLAIN, Style = toy_render.PLAIN, toy_render.Style
background_pixels, distance, finish = (
    toy_render.background_pixels,
    toy_render.distance,
    toy_render.finish,
)
mask, sample_style = toy_render.mask, toy_render.sample_style

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 70, 225),
    "yellow": (240, 215, 25),
    "purple": (135, 40, 185),
    "orange": (245, 135, 20),
}
# In order of roundness: neighbours are the look-alike pairs (see Variety.alike).
SHAPES = ("circle", "square", "triangle", "star")
SHAPE_PAIRS = tuple(itertools.combinations(range(len(SHAPES)), 2))
# The answer to "Where is the shape?" for the 3x3 cell [row][col] holding the shape's centre.
POSITIONS = (
    ("top left", "top", "top right"),
    ("left", "centre", "right"),
    ("bottom left", "bottom", "bottom right"),
)
COUNTS = ("one", "two")
ORDINALS = ("the first", "the second")

QUESTIONS = {
    "describe": "What is in the image?",
    "colour": "What colour is the shape?",
    "shape": "What shape is it?",
    "position": "Where is the shape?",
    "count": "How many shapes are there?",
    "which": "Which image shows a {shape}?",
    "same_colour": "Are the two shapes the same colour?",
    "nth_colour": "What colour is the shape in the {ordinal} image?",
    "nth_shape": "What shape is in the {ordinal} image?",
}
ONE_IMAGE_TASKS = ("describe", "colour", "shape", "position", "count")
# nth_colour and nth_shape are not among the questions the model was asked to answer: they train
# the language model to read each picture on its own, first or second: on the easiest feature
# (colour), which "are the two shapes the same colour?" builds on, and on shape, which "which
# image shows a circle?" builds on.
TWO_IMAGE_TASKS = ("which", "same_colour", "nth_colour", "nth_shape")
TASKS = ONE_IMAGE_TASKS + TWO_IMAGE_TASKS
# Questions of our own, beyond the ones the model is specified to answer (no accuracy target):
# count gives the two-shape pictures a question; the nth_ questions are training aids (above).
EXTRA_TASKS = ("count", "nth_colour", "nth_shape")


def accuracy_target(task: str) -> float | None:
    """Held-out accuracy the model is specified to reach on `task`: 97% for a one-picture
    question, 90% for a two-picture one; None for our extra questions."""
    if task in EXTRA_TASKS:
        return None
    return 0.97 if task in ONE_IMAGE_TASKS else 0.90


# Plain words for random system prompts, so the model copes with long shared prefixes.
WORDS = tuple(
    (  # noqa: SIM905 - a paragraph reads better than 80 one-word lines
        "you are a helpful assistant that answers questions about pictures briefly and exactly "
        "please look at the image carefully then reply with a few words only the user may ask "
        "about colour shape position or count be precise short clear honest kind calm simple "
        "this is a test of the serving engine cache prefix system prompt with many plain words "
        "red green blue yellow purple orange circle square triangle star left right top bottom"
    ).split()
)

# A centre closer than this (fraction of the side) to a 3x3 grid line would make
# "Where is the shape?" ambiguous, so such centres are never drawn.
CELL_MARGIN = 0.05
MIN_SIDE, MAX_SIDE = 56, 448
# Shape radius as a fraction of the picture's short side: for "Where is the shape?" 24-60% of
# it across, so that its centre can sit inside any cell. For the questions about what the shape
# is, the largest is 90% across; how small and how turned depends on the stage (`Variety`).
LARGEST_RADIUS = 0.45
CELL_RADIUS = (0.12, 0.30)
# Share of pictures that are not square (aspect ratios up to 3:1 either way).
NON_SQUARE = 0.35


@dataclass(frozen=True)
class Variety:
    """How far a training stage's shapes stray from the easiest: the share of shapes turned and
    by how much, and how small a shape about which the model is asked what it is may be, and
    how often. Easy pictures let the first stage learn to read shapes at all; the last mix
    widens them to what people draw (see the model card)."""

    name: str
    turned: float  # share of shapes (circles aside) that are turned
    max_angle: float  # radians, either way
    smallest: float  # the smallest radius, as a share of the short side (half its width across)
    # Radius drawn as smallest + (LARGEST_RADIUS - smallest) * u ** skew: below 1 skews towards
    # large shapes, 1 is uniform.
    skew: float
    # How many times as often a two-picture shape question (which, nth_shape) shows two look-alike
    # shapes (neighbours in SHAPES: circle and square, square and triangle, triangle and star) as
    # any other two. 1: every pair as often.
    alike: float = 1.0

    def size_share(self, rng: np.random.Generator) -> float:
        """A shape's radius as a share of the picture's short side."""
        return self.smallest + (LARGEST_RADIUS - self.smallest) * rng.random() ** self.skew

    def turn(self, rng: np.random.Generator) -> float:
        return rng.uniform(-self.max_angle, self.max_angle) if rng.random() < self.turned else 0.0


# 25-90% across, larger more often, half turned by up to 20 degrees: what the first stages see.
FIRST = Variety("first", turned=0.5, max_angle=math.radians(20), smallest=0.125, skew=0.5)
# 20-90% across, every size as often, 60% turned by up to 40 degrees; look-alike pairs 3x as often.
WIDE = Variety("wide", turned=0.6, max_angle=math.radians(40), smallest=0.1, skew=1.0, alike=3.0)
# The first stages' pictures, with look-alike pairs 3x as often: for the stage that teaches which.
PAIRS = replace(FIRST, name="pairs", alike=3.0)
VARIETIES = {v.name: v for v in (FIRST, PAIRS, WIDE)}


@dataclass(frozen=True)
class Shape:
    kind: str  # one of SHAPES
    colour: str  # one of COLOURS
    rgb: tuple[int, int, int]  # the colour, slightly jittered
    cx: float  # centre, pixels from the left
    cy: float  # centre, pixels from the top
    radius: float  # half the side of the bounding square before any turn, pixels
    angle: float = 0.0  # turned clockwise by this, radians
    # Proportions: a triangle's half base over its radius, a star's inner radius over 0.42 of
    # its outer one; 1.0 is the first checkpoint's shapes. Circles and squares ignore it.
    form: float = 1.0


@dataclass(frozen=True)
class Picture:
    width: int
    height: int
    background: tuple[int, int, int]
    shapes: tuple[Shape, ...]
    style: Style = PLAIN


@dataclass(frozen=True)
class Example:
    task: str
    pictures: tuple[Picture, ...]
    question: str
    answer: str
    system: str | None  # None: the chat template's default system prompt


def position_of(shape: Shape, width: int, height: int) -> str:
    col = min(int(3 * shape.cx / width), 2)
    row = min(int(3 * shape.cy / height), 2)
    return POSITIONS[row][col]


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def describe(picture: Picture) -> str:
    return " and ".join(f"{article(s.colour)} {s.colour} {s.kind}" for s in picture.shapes)


def sample_size(rng: np.random.Generator) -> tuple[int, int]:
    """Width and height in [56, 448]: mostly small, with aspect ratios up to 3:1 either way."""
    long_side = MIN_SIDE * 8 ** (rng.random() ** 1.6)
    aspect = math.exp(rng.uniform(0.0, math.log(3.0))) if rng.random() < NON_SQUARE else 1.0
    short_side = max(MIN_SIDE, long_side / aspect)
    long_px, short_px = round(min(long_side, MAX_SIDE)), round(min(short_side, MAX_SIDE))
    return (long_px, short_px) if rng.random() < 0.5 else (short_px, long_px)


def nearest_colour(rgb: tuple[int, int, int]) -> str:
    return min(COLOURS, key=lambda name: distance(COLOURS[name], rgb))


def _jitter(rng: np.random.Generator, colour: str) -> tuple[int, int, int]:
    """The colour, each channel moved by up to 20 levels, still nearest its own name's."""
    while True:
        noise = rng.integers(-20, 21, size=3)
        moved = np.clip(np.asarray(COLOURS[colour]) + noise, 0, 255)
        rgb = tuple(int(c) for c in moved)
        if nearest_colour(rgb) == colour:
            return rgb


def _styled(
    rng: np.random.Generator, width: int, height: int, shapes: tuple[Shape, ...]
) -> Picture:
    base, style = sample_style(rng, tuple(s.rgb for s in shapes))
    return Picture(width, height, base, shapes, style)


def _turn_and_form(rng: np.random.Generator, kind: str, variety: Variety) -> tuple[float, float]:
    angle = variety.turn(rng)
    form = {"triangle": rng.uniform(0.8, 1.15), "star": rng.uniform(0.9, 1.2)}.get(kind, 1.0)
    return (0.0 if kind == "circle" else angle), form


def vertices(kind: str, radius: float, angle: float = 0.0, form: float = 1.0):
    """The shape's corners around a centre at (0, 0), or None for a circle."""
    if kind == "circle":
        return None
    if kind == "square":
        points = [(-1, -1), (1, -1), (1, 1), (-1, 1)]
    elif kind == "triangle":
        points = [(0, -1), (form, 1), (-form, 1)]
    elif kind == "star":
        points = []
        for i in range(10):
            r = 1.0 if i % 2 == 0 else 0.42 * form
            a = -math.pi / 2 + i * math.pi / 5
            points.append((r * math.cos(a), r * math.sin(a)))
    else:
        raise ValueError(f"unknown shape {kind!r}")
    cos, sin = math.cos(angle), math.sin(angle)
    return [(radius * (x * cos - y * sin), radius * (x * sin + y * cos)) for x, y in points]


def extent(kind: str, angle: float, form: float) -> float:
    """How far the shape reaches from its centre along x or y, in radii."""
    points = vertices(kind, 1.0, angle, form)
    return 1.0 if points is None else max(max(abs(x), abs(y)) for x, y in points)


def _axis_range(cell: int, side: int, radius: float) -> tuple[float, float]:
    """Centre coordinates that keep the shape inside the picture and its centre inside `cell`."""
    lo = max(radius, (cell / 3 + CELL_MARGIN) * side)
    hi = min(side - radius, ((cell + 1) / 3 - CELL_MARGIN) * side)
    return lo, hi


def sample_single(
    rng: np.random.Generator,
    kind: str | None = None,
    colour: str | None = None,
    in_cell: bool = False,
    variety: Variety = FIRST,
) -> Picture:
    """A picture of one shape. With `in_cell` its centre lies well inside a random cell of the
    3x3 grid (for "Where is the shape?"); otherwise it is anywhere it fits, as large as the
    variety says."""
    width, height = sample_size(rng)
    kind = kind or SHAPES[rng.integers(len(SHAPES))]
    colour = colour or list(COLOURS)[rng.integers(len(COLOURS))]
    short = min(width, height)
    angle, form = _turn_and_form(rng, kind, variety)
    reach = extent(kind, angle, form)  # a turned shape reaches further
    rgb = _jitter(rng, colour)
    if not in_cell:
        radius = variety.size_share(rng) * short / reach
        half = radius * reach
        cx, cy = rng.uniform(half, width - half), rng.uniform(half, height - half)
        shape = Shape(kind, colour, rgb, cx, cy, radius, angle, form)
        return _styled(rng, width, height, (shape,))
    row, col = int(rng.integers(3)), int(rng.integers(3))
    # The largest radius that still lets the centre sit inside the chosen cell.
    max_radius = min(
        CELL_RADIUS[1] * short,
        ((col + 1) / 3 - CELL_MARGIN) * width if col == 0 else width,
        (1 - (col / 3 + CELL_MARGIN)) * width if col == 2 else width,
        ((row + 1) / 3 - CELL_MARGIN) * height if row == 0 else height,
        (1 - (row / 3 + CELL_MARGIN)) * height if row == 2 else height,
    )
    half = rng.uniform(min(CELL_RADIUS[0] * short, max_radius), max_radius)
    x_lo, x_hi = _axis_range(col, width, half)
    y_lo, y_hi = _axis_range(row, height, half)
    cx, cy = rng.uniform(x_lo, x_hi), rng.uniform(y_lo, y_hi)
    shape = Shape(kind, colour, rgb, cx, cy, half / reach, angle, form)
    return _styled(rng, width, height, (shape,))


def sample_pair(rng: np.random.Generator, variety: Variety = FIRST) -> Picture:
    """A picture of two shapes in different colours that do not touch."""
    width, height = sample_size(rng)
    short = min(width, height)
    colours = rng.choice(len(COLOURS), size=2, replace=False)
    while True:
        shapes = []
        for c in colours:
            kind = SHAPES[rng.integers(len(SHAPES))]
            angle, form = _turn_and_form(rng, kind, variety)
            half = rng.uniform(0.12, 0.22) * short
            name = list(COLOURS)[c]
            shapes.append(
                Shape(
                    kind,
                    name,
                    _jitter(rng, name),
                    cx=rng.uniform(half, width - half),
                    cy=rng.uniform(half, height - half),
                    radius=half / extent(kind, angle, form),
                    angle=angle,
                    form=form,
                )
            )
        a, b = shapes
        # Each shape lies inside the circle of radius `radius * sqrt(2)` around its centre.
        if math.hypot(a.cx - b.cx, a.cy - b.cy) > 1.45 * (a.radius + b.radius) + 2:
            return _styled(rng, width, height, tuple(shapes))


def _two_kinds(rng: np.random.Generator, variety: Variety) -> tuple[int, int]:
    """Two different shapes (indices into SHAPES), in random order; look-alike pairs as often
    as the variety says."""
    if variety.alike == 1:
        first, second = rng.choice(len(SHAPES), size=2, replace=False)
        return int(first), int(second)
    weights = np.array([variety.alike if b - a == 1 else 1.0 for a, b in SHAPE_PAIRS])
    a, b = SHAPE_PAIRS[rng.choice(len(SHAPE_PAIRS), p=weights / weights.sum())]
    return (a, b) if rng.random() < 0.5 else (b, a)


def _system_prompt(rng: np.random.Generator) -> str | None:
    if rng.random() < 0.75:
        return None
    num_words = int(math.exp(rng.uniform(0.0, math.log(120.0))))
    words = rng.choice(len(WORDS), size=num_words)
    text = " ".join(WORDS[w] for w in words)
    return text[0].upper() + text[1:] + "."


def _nth_question(task: str, target: int) -> str:
    """An nth_ question about picture `target` (0: the first)."""
    return QUESTIONS[task].format(ordinal=ORDINALS[target].removeprefix("the "))


def sample_example(rng: np.random.Generator, task: str, variety: Variety = FIRST) -> Example:
    """One question of `task` (see TASKS) about freshly drawn pictures, with its exact answer."""
    system = _system_prompt(rng)
    single = functools.partial(sample_single, rng, variety=variety)
    if task in ("describe", "colour", "shape", "position"):
        pic = single(in_cell=task == "position")
        s = pic.shapes[0]
        answer = {
            "describe": describe(pic),
            "colour": s.colour,
            "shape": s.kind,
            "position": position_of(s, pic.width, pic.height),
        }[task]
        return Example(task, (pic,), QUESTIONS[task], answer, system)
    if task == "count":
        num_shapes = int(rng.integers(1, 3))
        pic = single() if num_shapes == 1 else sample_pair(rng, variety)
        return Example(task, (pic,), QUESTIONS[task], COUNTS[num_shapes - 1], system)
    if task in ("which", "nth_shape"):  # two pictures of different shapes
        kinds = _two_kinds(rng, variety)
        pics = tuple(single(kind=SHAPES[k]) for k in kinds)
        target = int(rng.integers(2))
        if task == "which":
            question = QUESTIONS[task].format(shape=SHAPES[kinds[target]])
            return Example(task, pics, question, ORDINALS[target], system)
        return Example(task, pics, _nth_question(task, target), SHAPES[kinds[target]], system)
    if task == "same_colour":
        is_same = bool(rng.random() < 0.5)
        colours = rng.choice(len(COLOURS), size=2, replace=False)
        names = [list(COLOURS)[c] for c in colours]
        first = single(colour=names[0])
        second = single(colour=names[0] if is_same else names[1])
        return Example(task, (first, second), QUESTIONS[task], "yes" if is_same else "no", system)
    if task == "nth_colour":
        colours = rng.choice(len(COLOURS), size=2, replace=False)
        names = [list(COLOURS)[c] for c in colours]
        pics = tuple(single(colour=name) for name in names)
        target = int(rng.integers(2))
        return Example(task, pics, _nth_question(task, target), names[target], system)
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


def draw(picture: Picture) -> Image.Image:
    """Render a picture as an RGB image of exactly picture.width x picture.height."""
    w, h, style = picture.width, picture.height, picture.style
    pixels = background_pixels(w, h, picture.background, style)
    for s in picture.shapes:
        layers = [(s.rgb, 1.0)]
        if style.outline is not None:
            layers = [(style.outline, 1.0), (s.rgb, 1.0 - style.outline_width)]
        for rgb, share in layers:
            where, cover = mask(w, h, *_geometry(s, s.radius * share), style.antialias)
            cover = cover[..., None]
            pixels[where] = pixels[where] * (1 - cover) + np.asarray(rgb, np.float32) * cover
    return finish(pixels, style)


def _geometry(s: Shape, radius: float) -> tuple[str, tuple | list]:
    points = vertices(s.kind, radius, s.angle, s.form)
    if points is None:
        return "ellipse", (s.cx - radius, s.cy - radius, s.cx + radius, s.cy + radius)
    return "polygon", [(s.cx + x, s.cy + y) for x, y in points]


def render_prompt(example: Example, chat_template: str) -> str:
    """The chat template's rendering of the example's prompt, up to the assistant header."""
    content = [{"type": "image"} for _ in example.pictures]
    content.append({"type": "text", "text": example.question})
    messages = [{"role": "user", "content": content}]
    if example.system is not None:
        messages.insert(0, {"role": "system", "content": example.system})
    return _compiled(chat_template).render(messages=messages, add_generation_prompt=True)


@lru_cache(maxsize=4)
def _compiled(chat_template: str) -> jinja2.Template:
    # Compiling the template costs ~10 ms, far more than rendering it.
    return jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(chat_template)


def tokenizer_corpus(rng: np.random.Generator, num_examples: int = 3000) -> list[str]:
    """Texts to train the BPE tokenizer on: every question, answer and system-prompt word."""
    texts = ["You are a helpful assistant.", " ".join(WORDS)]
    for _ in range(num_examples):
        ex = sample_example(rng, TASKS[rng.integers(len(TASKS))])
        texts.extend([ex.question, ex.answer, ex.system or ""])
    texts.extend(QUESTIONS.values())
    return texts
