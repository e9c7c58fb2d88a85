"""The toy training script's curriculum: how stages are parsed and described on the model card."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import train_toy_model as train  # noqa: E402
from toy_batches import PixelConfig, SpecialIds, collate, encode  # noqa: E402
from toy_card import (  # noqa: E402
    STAGE_GATE_EVERY,
    StageEnd,
    _curriculum,
    _gate_text,
    _shortfalls,
    _stages_text,
    last_stage_extra,
)
from toy_data import FIRST, TASKS, WIDE, sample_example  # noqa: E402

from mmserve.config.model import bundled_toy_model_dir  # noqa: E402


def test_a_stage_draws_only_the_tasks_it_names() -> None:
    stages = train.parse_stages(["300:which=1", "500:colour=2,shape=1"])
    assert stages[300] == {**dict.fromkeys(TASKS, 0.0), "which": 1.0}
    assert stages[500]["colour"] == 2.0 and stages[500]["shape"] == 1.0
    assert sum(stages[500].values()) == 3.0


def test_a_stage_names_the_variety_of_its_pictures_after_an_at() -> None:
    items = ["300:which=1", "500:colour=2,shape=1@wide"]
    args = argparse.Namespace(stage=items)
    assert train.stage_varieties(args) == {0: FIRST, 300: FIRST, 500: WIDE}
    assert train.parse_stages(items)[500]["colour"] == 2.0  # the weights stop at the '@'
    assert train.stage_varieties(argparse.Namespace(stage=["0:shape=1@wide"])) == {0: WIDE}


@pytest.mark.parametrize("bad", ["which=1", "x:which=1", "300:nope=1", "300:which=1@huge"])
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


def test_the_card_marks_the_stages_that_draw_wide_pictures() -> None:
    stages = {0: {"shape": 1.0}, 100: {"which": 1.0}}
    lines = _curriculum(stages, 250, {0: "first", 100: "wide"}).splitlines()
    assert lines == ["- steps 0-99: shape 100%", "- steps 100-249: which 100% (wide pictures)"]


def test_a_stretched_last_stage_runs_longer_on_the_same_decay() -> None:
    """The last stage runs `stretch` times its planned steps; the schedule before it is the
    plan's own, and through it the plan's steps pass `stretch` times slower."""
    stages = ["100:which=1", "200:shape=1"]
    args = argparse.Namespace(steps=300, stage=stages, last_stage_stretch=1.5)
    assert last_stage_extra(args) == 50
    plan = {0: ONE_PICTURE, 100: ONE_PICTURE, 200: ONE_PICTURE}
    walker = train.StageWalker(plan, 0.9, 300, stretch=1.5)
    planned = []
    for step in range(350):
        walker.next_mix(step, lambda task: 1.0)
        planned.append(walker.planned_step(step))
    assert list(walker.started) == [0, 100, 200]
    assert planned[:201] == list(range(201))
    assert planned[201:] == pytest.approx([200 + k / 1.5 for k in range(1, 150)])
    assert 299 <= planned[-1] < 300  # the decay ends where the plan's did


def test_extra_questions_have_no_target() -> None:
    accs = dict.fromkeys(TASKS, 1.0) | {"count": 0.5, "nth_colour": 0.5}
    assert _shortfalls(accs) == "Every specified question meets its target."
    assert "which (89.0%)" in _shortfalls(accs | {"which": 0.89})


def _walk(walker: train.StageWalker, steps: int, accuracy) -> dict[int, dict[str, float]]:
    for step in range(steps):
        walker.next_mix(step, accuracy)
    return walker.started


ONE_PICTURE = {"shape": 1.0, "colour": 1.0, "which": 0.0}
WHICH_ALONE = {"shape": 0.0, "colour": 0.0, "which": 1.0}


def test_stages_start_as_planned_when_each_one_question_stage_has_taken() -> None:
    asked = []
    walker = train.StageWalker({0: ONE_PICTURE, 100: WHICH_ALONE, 200: ONE_PICTURE}, 0.9, 300)
    started = _walk(walker, 300, lambda task: asked.append(task) or 0.95)
    assert list(started) == [0, 100, 200]
    assert asked == ["which"]  # only a one-question stage is checked, once, at its end
    assert walker.ends == [StageEnd("which", 200, 0, 0.95)]


def test_a_one_question_stage_runs_on_until_it_has_taken_and_later_stages_move() -> None:
    scores = iter([0.5, 0.7, 0.92])  # below the gate twice, then above
    walker = train.StageWalker(
        {0: ONE_PICTURE, 100: WHICH_ALONE, 200: ONE_PICTURE, 250: WHICH_ALONE}, 0.9, 300
    )
    started = _walk(walker, 400, lambda task: next(scores, 1.0))
    assert list(started) == [0, 100, 300, 350]
    assert walker.ends[0] == StageEnd("which", 300, 100, 0.92)


def test_a_stage_that_runs_on_lengthens_the_run_and_holds_the_schedule() -> None:
    scores = iter([0.5, 0.92])  # one extra chunk of steps, then taken
    every = STAGE_GATE_EVERY
    walker = train.StageWalker({0: ONE_PICTURE, 100: WHICH_ALONE, 200: ONE_PICTURE}, 0.9, 300)
    planned = []
    step = 0
    while step < 300 + walker.delay:  # as the training loop runs a 300-step plan
        walker.next_mix(step, lambda task: next(scores))
        planned.append(walker.planned_step(step))
        step += 1
    assert step == 300 + every  # the last stage still got its planned 100 steps
    assert list(walker.started) == [0, 100, 200 + every]
    # The extra steps sit at the stage's last planned step; the plan then goes on where it was.
    assert planned[:200] == list(range(200))
    assert planned[200 : 200 + every] == [199] * every
    assert planned[200 + every :] == list(range(200, 300))


def test_a_stage_teaches_the_question_it_draws_at_least_three_times_in_four() -> None:
    assert train.focus_task(WHICH_ALONE) == "which"
    assert train.focus_task({"which": 1.0, "describe": 0.1, "shape": 0.1, "colour": 0.0}) == "which"
    assert train.focus_task({"which": 1.0, "describe": 0.4}) is None
    assert train.focus_task(ONE_PICTURE) is None
    # A stage that keeps a few other answers alive is gated like one that draws its question alone.
    kept_alive = {"which": 1.0, "shape": 0.2, "colour": 0.0}
    walker = train.StageWalker({0: ONE_PICTURE, 100: kept_alive, 200: ONE_PICTURE}, 0.9, 300)
    started = _walk(walker, 300, lambda task: 0.95)
    assert list(started) == [0, 100, 200]
    assert walker.ends == [StageEnd("which", 200, 0, 0.95)]


def test_a_stage_that_never_takes_ends_after_the_most_extra_steps() -> None:
    walker = train.StageWalker({0: WHICH_ALONE, 100: ONE_PICTURE}, 0.9, 100)
    started = _walk(walker, 400, lambda task: 0.1)
    assert list(started) == [0, 200]
    assert walker.ends == [StageEnd("which", 200, 100, 0.1)]


def test_gate_zero_keeps_the_plan_and_asks_nothing() -> None:
    def never(task: str) -> float:
        raise AssertionError("no accuracy is asked with the gate off")

    walker = train.StageWalker({0: WHICH_ALONE, 100: ONE_PICTURE}, 0.0, 300)
    assert list(_walk(walker, 200, never)) == [0, 100]


def test_the_card_says_how_each_one_question_stage_ended() -> None:
    args = argparse.Namespace(
        steps=5000, stage_gate=0.9, stage_max_extra=300, stage=[], last_stage_stretch=1.0
    )
    ends = [StageEnd("nth_colour", 2900, 0, 1.0), StageEnd("which", 3650, 50, 0.91)]
    text = " ".join(_gate_text(args, ends).split())
    assert "until that question's held-out monitor accuracy" in text
    assert "nth_colour ended at step 2900, as planned (100%)" in text
    assert "which ended at step 3650, 50 steps over plan (91%)" in text
    assert "5050 steps in all (5000 planned)" in text
    off = argparse.Namespace(
        steps=5000, stage_gate=0.0, stage_max_extra=300, stage=[], last_stage_stretch=1.0
    )
    assert _gate_text(off, ends) == ""


def test_the_card_explains_each_training_aid_only_when_the_run_trained_it() -> None:
    args = argparse.Namespace(
        steps=300, stage_gate=0.0, stage_max_extra=0, stage=[], last_stage_stretch=1.0
    )
    without = _stages_text({0: ONE_PICTURE, 100: WHICH_ALONE}, args, [])
    with_nth = _stages_text({0: ONE_PICTURE, 100: {"nth_colour": 1.0}}, args, [])
    both = _stages_text(
        {0: ONE_PICTURE, 100: {"nth_shape": 1.0}, 200: {"nth_colour": 1.0}}, args, []
    )
    assert "nth_" not in without
    assert "tell the first picture from the second" in with_nth and "nth_shape" not in with_nth
    assert '`nth_shape` ("What shape is in the second image?' in both and "`nth_colour`" in both


def test_the_defaults_are_the_shipped_checkpoints_command(monkeypatch) -> None:
    """The card documents the one command that trained the shipped weights, every flag spelled
    out; the README's short form (`--seed 0 --threads 2`) relies on the script's defaults being
    that command, so changing a default must fail here rather than silently stop reproducing."""
    card = (Path(bundled_toy_model_dir()) / "README.md").read_text()
    commands = [line for line in card.splitlines() if line.startswith("python scripts/train")]
    assert len(commands) == 1, commands
    monkeypatch.setattr(sys, "argv", shlex.split(commands[0])[1:])
    documented = train.parse_args()
    monkeypatch.setattr(sys, "argv", ["train_toy_model.py", "--out", str(documented.out)])
    defaults = train.parse_args()
    assert train.curriculum(documented) == train.curriculum(defaults)
    assert train.stage_varieties(documented) == train.stage_varieties(defaults)
    ignored = {"threads", "weights", "stage"}  # the curriculum compares the last two
    assert {k: v for k, v in vars(documented).items() if k not in ignored} == {
        k: v for k, v in vars(defaults).items() if k not in ignored
    }
    assert documented.seed == 0 and documented.threads == 2


def _shipped_encoding() -> tuple[Path, Tokenizer, SpecialIds, PixelConfig, str]:
    """The bundled checkpoint's directory and what `encode` needs from it."""
    toy = Path(bundled_toy_model_dir())
    tok = Tokenizer.from_file(str(toy / "tokenizer.json"))
    ids = SpecialIds.from_vocab(tok.get_vocab())
    template = json.loads((toy / "tokenizer_config.json").read_text())["chat_template"]
    px = PixelConfig.from_dict(json.loads((toy / "preprocessor_config.json").read_text()))
    return toy, tok, ids, px, template


def test_the_answer_only_loss_is_the_models_own_loss() -> None:
    """The training loss applies the output layer only at answer positions; it must equal the
    loss transformers computes over the whole sequence."""
    toy, tok, ids, px, template = _shipped_encoding()
    rng = np.random.default_rng(5)
    batch = [encode(sample_example(rng, t), tok, ids, px, template) for t in TASKS]
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        toy, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        full = model(**collate(batch, ids)).loss
        answers_only = train.answer_loss(model, collate(batch, ids))
    torch.testing.assert_close(answers_only, full, rtol=1e-5, atol=1e-6)


def test_the_auxiliary_heads_train_the_vision_tower_and_skip_two_shape_pictures() -> None:
    from toy_aux import IGNORE, AuxHeads, picture_labels

    toy, tok, ids, px, template = _shipped_encoding()
    rng = np.random.default_rng(6)
    examples = [sample_example(rng, t) for t in ("shape", "which", "count", "count", "count")]
    pair = next(p for ex in examples for p in ex.pictures if len(p.shapes) == 2)
    assert picture_labels(pair)[:2] == (IGNORE, IGNORE)
    batch = [encode(ex, tok, ids, px, template) for ex in examples]
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(toy, dtype=torch.float32)
    heads = AuxHeads(model.config.text_config.hidden_size)
    model.model.visual.merger.register_forward_hook(heads.capture)
    inputs = collate(batch, ids)
    labels = torch.tensor([label for e in batch for label in e.aux])
    assert len(labels) == len(inputs["image_grid_thw"])
    train.answer_loss(model, dict(inputs))
    loss = heads.loss(inputs["image_grid_thw"], labels, 2)
    loss.backward()
    assert loss.item() > 0 and heads.captured == []
    assert model.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0
    # Only one-shape pictures are scored: labels all ignored give no loss.
    train.answer_loss(model, dict(inputs))
    none = heads.loss(inputs["image_grid_thw"], torch.full_like(labels, IGNORE), 2)
    assert none.item() == 0.0
