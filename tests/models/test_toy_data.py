"""The toy model's data generator: seeded, and every answer agrees with the drawn picture."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.factory import QWEN2_VL_CHAT_TEMPLATE, build_tokenizer
from tests.support.processor_configs import preprocessor_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from toy_data import (  # noqa: E402
    COLOURS,
    COUNTS,
    FIRST,
    ORDINALS,
    POSITIONS,
    SHAPES,
    TASKS,
    VARIETIES,
    WIDE,
    Example,
    Picture,
    describe,
    draw,
    nearest_colour,
    render_prompt,
    sample_example,
)
from toy_render import BACKGROUNDS, MAX_OUTLINE, MIN_CONTRAST, PLAIN  # noqa: E402


def _stream(seed: int, n: int) -> list[Example]:
    rng = np.random.default_rng(seed)
    return [sample_example(rng, TASKS[i % len(TASKS)]) for i in range(n)]


def test_same_seed_same_examples_and_pixels() -> None:
    a, b = _stream(7, 28), _stream(7, 28)
    assert a == b
    for x, y in zip(a, b, strict=True):
        for p, q in zip(x.pictures, y.pictures, strict=True):
            assert draw(p).tobytes() == draw(q).tobytes()
    assert _stream(8, 28) != a


def _plain(picture: Picture) -> Picture:
    """The same shapes, upright, hard-edged on the flat base background, PNG: what the answer
    checks below read exact pixel colours from (the styles are checked on their own)."""
    upright = tuple(dataclasses.replace(s, angle=0.0) for s in picture.shapes)
    return dataclasses.replace(picture, shapes=upright, style=PLAIN)


def _pixels_of(picture: Picture, rgb: tuple[int, int, int]) -> np.ndarray:
    arr = np.asarray(draw(_plain(picture)))  # [H, W, 3]
    return np.argwhere((arr == np.array(rgb)).all(axis=-1))  # [num_pixels, 2] (row, col)


def _seen_shape(picture: Picture, rgb: tuple[int, int, int]) -> str:
    """Classify a drawn shape by how much of its bounding box it fills."""
    pts = _pixels_of(picture, rgb)
    box = (np.ptp(pts[:, 0]) + 1) * (np.ptp(pts[:, 1]) + 1)
    fill = len(pts) / box
    return (
        "square"
        if fill > 0.9
        else "circle"
        if fill > 0.65
        else "triangle"
        if fill > 0.465
        else "star"
    )


def _seen_colour(rgb: tuple[int, int, int]) -> str:
    return min(
        COLOURS, key=lambda c: sum((a - b) ** 2 for a, b in zip(COLOURS[c], rgb, strict=True))
    )


def _seen_position(picture: Picture, rgb: tuple[int, int, int]) -> str:
    pts = _pixels_of(picture, rgb)
    (top, left), (bottom, right) = pts.min(axis=0), pts.max(axis=0)
    row = int(3 * (top + bottom + 1) / 2 / picture.height)
    col = int(3 * (left + right + 1) / 2 / picture.width)
    return POSITIONS[row][col]


def _seen_colours(picture: Picture) -> list[str]:
    arr = np.asarray(draw(_plain(picture))).reshape(-1, 3)
    colours = {tuple(int(v) for v in px) for px in np.unique(arr, axis=0)}
    return [_seen_colour(c) for c in colours if c != picture.background]


@pytest.mark.parametrize("task", TASKS)
def test_answers_match_the_drawn_pictures(task: str) -> None:
    rng = np.random.default_rng(123)
    for _ in range(60):
        ex = sample_example(rng, task)
        shapes = [p.shapes[0] for p in ex.pictures]
        if task in ("describe", "colour", "shape", "position"):
            pic, rgb = ex.pictures[0], shapes[0].rgb
            seen = {
                "colour": _seen_colour(rgb),
                "shape": _seen_shape(pic, rgb),
                "position": _seen_position(pic, rgb),
                "describe": describe(pic),
            }[task]
            assert ex.answer == seen, ex
            if task == "describe":
                colour, kind = _seen_colour(rgb), _seen_shape(pic, rgb)
                assert seen == f"{'an' if colour == 'orange' else 'a'} {colour} {kind}"
        elif task == "count":
            assert ex.answer == COUNTS[len(_seen_colours(ex.pictures[0])) - 1]
        elif task == "which":
            seen = [_seen_shape(p, s.rgb) for p, s in zip(ex.pictures, shapes, strict=True)]
            asked = next(s for s in SHAPES if ex.question == f"Which image shows a {s}?")
            assert seen.count(asked) == 1
            assert ex.answer == ORDINALS[seen.index(asked)]
        elif task == "nth_colour":
            seen = [_seen_colours(p) for p in ex.pictures]
            assert all(len(colours) == 1 for colours in seen) and seen[0] != seen[1]
            nth = 0 if "first" in ex.question else 1
            assert ex.question == f"What colour is the shape in the {ORDINALS[nth][4:]} image?"
            assert ex.answer == seen[nth][0]
        elif task == "nth_shape":
            seen = [_seen_shape(p, s.rgb) for p, s in zip(ex.pictures, shapes, strict=True)]
            assert seen[0] != seen[1]
            nth = 0 if "first" in ex.question else 1
            assert ex.question == f"What shape is in the {ORDINALS[nth][4:]} image?"
            assert ex.answer == seen[nth]
        else:
            assert task == "same_colour"
            first, second = (_seen_colours(p) for p in ex.pictures)
            assert ex.answer == ("yes" if first == second else "no")


def test_picture_sizes_cover_the_dynamic_resolution_range() -> None:
    pictures = [p for ex in _stream(3, 700) for p in ex.pictures]
    widths = np.array([p.width for p in pictures])
    heights = np.array([p.height for p in pictures])
    assert widths.min() >= 56 and heights.min() >= 56
    assert widths.max() <= 448 and heights.max() <= 448
    assert max(widths.max(), heights.max()) > 380
    aspect = widths / heights
    assert aspect.min() < 0.45 and aspect.max() > 2.2
    assert np.median(np.maximum(widths, heights)) < 224


@pytest.mark.parametrize("num_images", [1, 2])
@pytest.mark.parametrize("system", [None, "Be brief and exact."])
def test_prompt_is_the_chat_template_rendering(
    tmp_path: Path, num_images: int, system: str | None
) -> None:
    transformers = pytest.importorskip("transformers")
    build_tokenizer(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    pic = Picture(64, 64, (128, 128, 128), ())
    ex = Example("which", (pic,) * num_images, "Which image shows a star?", "the first", system)
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": ex.question}]
    messages = [{"role": "user", "content": content}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_prompt(ex, QWEN2_VL_CHAT_TEMPLATE) == expected


@pytest.mark.parametrize(
    ("min_pixels", "max_pixels"), [(84 * 84, 112 * 112), (112 * 112, 168 * 168)]
)
def test_training_pixels_match_the_transformers_image_processor(
    min_pixels: int, max_pixels: int
) -> None:
    transformers = pytest.importorskip("transformers")
    from toy_batches import PixelConfig, image_patches

    cfg = preprocessor_config(min_pixels, max_pixels)
    processor = transformers.Qwen2VLImageProcessorPil(
        **{k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")}
    )
    px = PixelConfig.from_dict(cfg)
    for ex in _stream(5, 14):
        for picture in ex.pictures:
            image = draw(picture)
            want = processor(images=[image], return_tensors="np")
            got, grid = image_patches(image, px)
            assert [list(grid)] == want["image_grid_thw"].tolist()
            np.testing.assert_allclose(got, want["pixel_values"], atol=1e-5)


def _single_pictures(seed: int, n: int, variety=FIRST) -> list[Picture]:
    rng = np.random.default_rng(seed)
    tasks = ("describe", "colour", "shape", "position")
    return [sample_example(rng, tasks[i % 4], variety).pictures[0] for i in range(n)]


@pytest.mark.parametrize("variety", VARIETIES.values(), ids=lambda v: v.name)
def test_styles_cover_what_people_draw(variety) -> None:
    pictures = _single_pictures(11, 600, variety)
    styles = [p.style for p in pictures]
    assert {s.background for s in styles} == set(BACKGROUNDS)
    assert {s.antialias for s in styles} == {True, False}
    outlined = [s for s in styles if s.outline is not None]
    assert 0.2 < len(outlined) / len(styles) < 0.5
    assert all(0 < s.outline_width <= MAX_OUTLINE for s in outlined)
    qualities = [s.jpeg_quality for s in styles if s.jpeg_quality is not None]
    assert 0.25 < len(qualities) / len(styles) < 0.55
    assert min(qualities) >= 60 and max(qualities) <= 95
    bases = np.array([p.background for p in pictures])
    assert (np.ptp(bases, axis=1) > 60).mean() > 0.2  # plenty of colours, not only greys
    turned = np.array([abs(s.angle) for p in pictures for s in p.shapes if s.kind != "circle"])
    assert abs(np.mean(turned > 0) - variety.turned) < 0.1
    assert variety.max_angle * 0.9 < max(turned) <= variety.max_angle
    # A shape asked about spans from twice the variety's smallest radius to ~90% of the short
    # side, whatever its turn; the wide variety draws small ones as often as large ones.
    rng = np.random.default_rng(12)
    spans = []
    for _ in range(400):
        pic = sample_example(rng, "shape", variety).pictures[0]
        pts = _pixels_of(pic, pic.shapes[0].rgb)
        spans.append((np.ptp(pts, axis=0) + 1).max() / min(pic.width, pic.height))
    smallest = 2 * variety.smallest
    assert smallest - 0.05 < min(spans) < smallest + 0.1 and 0.8 < max(spans) <= 1.0
    small = np.mean(np.array(spans) < 0.45)
    assert (0.2 < small < 0.45) if variety is WIDE else (small < 0.2)


def test_colour_names_stay_truthful_under_every_style() -> None:
    """Each background colour keeps its distance from the fill, and after outlines, noise,
    gradients and JPEG the shape's middle is still nearest its own name's colour."""
    for pic in _single_pictures(13, 300):
        s = pic.shapes[0]
        assert nearest_colour(s.rgb) == s.colour
        for colour in pic.style.colours or (pic.background,):
            assert math.dist(colour, s.rgb) >= MIN_CONTRAST
        row = int(s.cy + (0.3 * s.radius if s.kind == "triangle" else 0))
        middle = np.asarray(draw(pic))[row, int(s.cx)]
        assert nearest_colour(tuple(int(v) for v in middle)) == s.colour, pic


def test_an_orange_shape_takes_an() -> None:
    rng = np.random.default_rng(14)
    answers = {sample_example(rng, "describe").answer for _ in range(200)}
    assert any(a.startswith("an orange ") for a in answers)
    assert not any(a.startswith("a orange") for a in answers)
