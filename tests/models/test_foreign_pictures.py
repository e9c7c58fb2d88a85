"""The foreign drawing routine: seeded, truthful, and unlike the training generator."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from foreign_pictures import (  # noqa: E402
    BACKGROUND_KINDS,
    FOREIGN_TASKS,
    draw_foreign,
    position_answer,
    questions,
)
from toy_data import COLOURS, SHAPES, nearest_colour  # noqa: E402


def test_same_seed_same_pictures() -> None:
    a, b = questions("describe", 6, 3), questions("describe", 6, 3)
    assert a == b and questions("describe", 6, 4) != a
    for x, y in zip(a, b, strict=True):
        assert draw_foreign(x.pictures[0]).tobytes() == draw_foreign(y.pictures[0]).tobytes()


def test_the_middle_of_each_shape_is_its_named_colour() -> None:
    """Outlines, backgrounds and JPEG never change what colour the shape is."""
    for task in ("describe", "colour", "shape", "position"):
        for q in questions(task, 40, 5):
            pic = q.pictures[0]
            s = pic.shape
            assert s.colour in COLOURS and s.kind in SHAPES
            middle = np.asarray(draw_foreign(pic))[int(s.cy), int(s.cx)]
            assert nearest_colour(tuple(int(v) for v in middle)) == s.colour
            assert all(math.dist(c, s.rgb) >= 100 for c in pic.colours[:1])


def test_answers_follow_the_pictures() -> None:
    for q in questions("describe", 30, 6):
        s = q.pictures[0].shape
        article = "an" if s.colour == "orange" else "a"
        assert q.answer == f"{article} {s.colour} {s.kind}"
    for q in questions("position", 60, 6):
        pic = q.pictures[0]
        assert q.answer == position_answer(pic)
        s = pic.shape  # the whole shape inside the picture, its centre well inside its cell
        assert s.size / 2 <= s.cx <= pic.width - s.size / 2
        col = 3 * s.cx / pic.width
        assert abs(col - round(col)) >= 0.05 or round(col) in (0, 3)
    for q in questions("which", 30, 6):
        kinds = [p.shape.kind for p in q.pictures]
        asked = q.question.removeprefix("Which image shows a ").removesuffix("?")
        assert kinds.count(asked) == 1
        assert q.answer == ("the first" if kinds[0] == asked else "the second")
    for q in questions("same_colour", 30, 6):
        colours = [p.shape.colour for p in q.pictures]
        assert q.answer == ("yes" if colours[0] == colours[1] else "no")


def test_every_condition_occurs() -> None:
    pictures = [q.pictures[0] for task in FOREIGN_TASKS[:4] for q in questions(task, 60, 8)]
    assert {p.background for p in pictures} == set(BACKGROUND_KINDS)
    seen = {k: {p.conditions()[k] for p in pictures} for k in pictures[0].conditions()}
    assert seen["outline"] == {"outlined", "no outline"}
    assert seen["edges"] == {"smooth", "hard"}
    assert "PNG" in seen["format"] and len(seen["format"]) > 2
    assert seen["turned"] == {"turned", "upright"}
