"""The toy training script's curriculum: how stages are parsed and described on the model card."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import train_toy_model as train  # noqa: E402
from toy_card import _curriculum, _shortfalls  # noqa: E402
from toy_data import TASKS  # noqa: E402


def test_a_stage_draws_only_the_tasks_it_names() -> None:
    stages = train.parse_stages(["300:which=1", "500:colour=2,shape=1"])
    assert stages[300] == {**dict.fromkeys(TASKS, 0.0), "which": 1.0}
    assert stages[500]["colour"] == 2.0 and stages[500]["shape"] == 1.0
    assert sum(stages[500].values()) == 3.0


@pytest.mark.parametrize("bad", ["which=1", "x:which=1", "300:nope=1"])
def test_bad_stages_are_refused_with_the_reason(bad: str) -> None:
    with pytest.raises(SystemExit, match="--stage|--weights"):
        train.parse_stages([bad])


def test_the_default_curriculum_parses_and_every_stage_draws_something() -> None:
    stages = train.parse_stages(list(train.CURRICULUM))
    assert sorted(stages) == [int(s.split(":")[0]) for s in train.CURRICULUM]
    assert all(sum(mix.values()) > 0 for mix in stages.values())


def test_the_card_lists_each_stage_with_its_steps_and_shares() -> None:
    stages = {0: {"shape": 3.0, "colour": 1.0}, 100: {"which": 1.0, "colour": 0.0}}
    assert _curriculum(stages, 250).splitlines() == [
        "- steps 0-99: shape 75%, colour 25%",
        "- steps 100-249: which 100%",
    ]


def test_extra_questions_have_no_target() -> None:
    accs = dict.fromkeys(TASKS, 1.0) | {"count": 0.5, "nth_colour": 0.5}
    assert _shortfalls(accs) == "Every specified question meets its target."
    assert "which (89.0%)" in _shortfalls(accs | {"which": 0.89})
