"""The bundled toy model answers about pictures it was not trained on: drawn by a second,
independent routine (scripts/foreign_pictures.py), asked through mmserve's offline API."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from eval_foreign import answers  # noqa: E402
from foreign_pictures import FOREIGN_TASKS, questions  # noqa: E402

from mmserve import LLM  # noqa: E402

TEST_SEED = 77  # not the model card's seed, so the card's figures are not re-asked here
PER_TASK = 8  # 48 pictures in all, every foreign question


@pytest.fixture(scope="module")
def toy() -> LLM:
    return LLM()


def test_foreign_pictures_are_answered(toy) -> None:
    qs = [q for task in FOREIGN_TASKS for q in questions(task, PER_TASK, TEST_SEED)]
    got = answers(toy, qs)
    wrong = [(q.task, q.answer, g) for q, g in zip(qs, got, strict=True) if g != q.answer]
    assert len(qs) == 48
    assert len(wrong) <= 0.1 * len(qs), wrong
