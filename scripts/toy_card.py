"""Write the toy checkpoint's model card (README.md) with the measured held-out accuracy."""

from __future__ import annotations

import argparse
import json
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

from toy_data import (
    CELL_RADIUS,
    COLOURS,
    EXTRA_TASKS,
    FIRST,
    LARGEST_RADIUS,
    NON_SQUARE,
    POSITIONS,
    QUESTIONS,
    SHAPES,
    VARIETIES,
    accuracy_target,
)
from toy_render import BACKGROUND_SHARES, BACKGROUNDS, MAX_OUTLINE, MIN_CONTRAST

FOREIGN_BEGIN, FOREIGN_END = "<!-- FOREIGN_BEGIN -->", "<!-- FOREIGN_END -->"

# A gated stage is checked, and runs on, this many steps at a time.
STAGE_GATE_EVERY = 50


@dataclass(frozen=True)
class StageEnd:
    """How a stage that teaches one question ended: at which step, how far past its plan, how
    well."""

    task: str
    step: int
    extra_steps: int
    accuracy: float  # the held-out monitor's teacher-forced accuracy on `task`


@dataclass(frozen=True)
class TrainStats:
    seconds: float  # wall time of the training loop (held-out checks and saves included)
    threads: int  # torch threads
    max_load: float  # the busiest 1-minute load average seen while training
    stages: dict[int, dict[str, float]]  # the curriculum as it ran: {first step: task weights}
    stage_ends: list[StageEnd]  # one per stage that teaches one question, in order
    pictures: dict[int, str]  # as it ran: {first step: the name of its pictures' Variety}


TASK_ROWS = {
    "describe": ("What is in the image?", "a red circle / an orange star"),
    "colour": ("What colour is the shape?", "red"),
    "shape": ("What shape is it?", "circle"),
    "position": ("Where is the shape?", "top left"),
    "count": ("How many shapes are there?", "one / two"),
    "which": ("Which image shows a circle? (two images)", "the first / the second"),
    "same_colour": ("Are the two shapes the same colour? (two images)", "yes / no"),
    "nth_colour": ("What colour is the shape in the first image? (two images)", "red"),
    "nth_shape": ("What shape is in the second image? (two images)", "star"),
}


def _commands(args: argparse.Namespace) -> str:
    base = f"python scripts/train_toy_model.py --out src/mmserve/models/toy --seed {args.seed}"
    run = (
        f"--steps {args.steps} --batch-size {args.batch_size} --lr {args.lr}"
        f" --vision-dim {args.vision_dim} --rope-theta {args.rope_theta:g}"
        f" --mrope-section {args.mrope_section} --text-layers {args.text_layers}"
        f" --vision-lr-scale {args.vision_lr_scale:g}"
        f" --aux-weight {args.aux_weight:g}"
        f" --vision-rope-theta {args.vision_rope_theta:g}"
        f" --min-pixels {args.min_pixels} --max-pixels {args.max_pixels}"
        + (" --vision-ids" if args.vision_ids else "")
        + (f" --weights {args.weights}" if args.weights else "")
        + "".join(f" --stage {stage}" for stage in args.stage)
        + (
            f" --stage-gate {args.stage_gate:g} --stage-max-extra {args.stage_max_extra}"
            if args.stage_gate > 0
            else ""
        )
        + (f" --focus-batch-size {args.focus_batch_size}" if args.focus_batch_size else "")
        + (
            f" --last-stage-stretch {args.last_stage_stretch:g}"
            if args.last_stage_stretch != 1
            else ""
        )
        + (f" --threads {args.threads}" if args.threads else "")
    )
    if not args.resume:
        return f"{base} {run}"
    # A resumed checkpoint: the first stage ran with the script's defaults.
    threads = f" --threads {args.threads}" if args.threads else ""
    return f"{base}{threads}\n{base} --resume {run}"


def _target_text(task: str) -> str:
    target = accuracy_target(task)
    return "extra" if target is None else f"{100 * target:.0f}%"


def _shortfalls(accs: dict[str, float]) -> str:
    short = [
        f"{task} ({100 * acc:.1f}%)"
        for task, acc in accs.items()
        if accuracy_target(task) is not None and acc < accuracy_target(task)
    ]
    if not short:
        return "Every specified question meets its target."
    return "Still short of target, so expect wrong answers there: " + ", ".join(short) + "."


def _labels(args: argparse.Namespace) -> str:
    if not args.vision_ids:
        return ""
    return (
        " with its picture labels on by default (each picture is preceded by `Picture 1: `,"
        " `Picture 2: `, ...; Qwen2-VL's `add_vision_id`, which the template here turns on"
        " unless a caller sets it to false)"
    )


def _lessons(args: argparse.Namespace) -> str:
    """Why the model is trained the way it is: what this project measured, in short."""
    t, h, w = (int(x) for x in args.mrope_section.split(","))
    paragraphs = [
        "## Why it is trained this way",
        "What a model this small can learn in ~25 CPU-minutes comes down to a few things; each "
        "was measured (runs of 900-7900 steps, 64-200 held-out questions per task; the runs "
        "that are not this checkpoint are listed under Other runs).",
        "- **Reading a picture.** A shape is told apart by a few of its picture's tokens (the "
        "corners and edges), but the language model reads a picture through attention, which "
        "starts out as an average over all of them. The same vision tower under a linear head "
        "learned shape to 98% in 600 steps with its tokens max-pooled, and to only 56% with "
        "them averaged. Shape is therefore the slowest one-picture question, and fewer tokens "
        "per picture help: at 7056-12544 pixels (9-16 tokens) a training step costs about half "
        "of one at 12544-28224 (16-36 tokens), with the same accuracy per step.",
        "- **Pictures drawn any way.** The first checkpoints saw one generator's pictures only "
        "(flat grey backgrounds, hard-edged upright shapes 56-84% across, PNG) and learned that "
        "generator: on pictures drawn by other code they were right 36 of 36 times on white, "
        "black or grey, but 14 of 24 on beige or light blue and 29 of 48 on tinted mid greys. "
        "Training on the varied pictures above with the same recipe made shape the bottleneck: "
        "at steps 500 / 1000 / 1500 / 2000 the held-out monitor read shape 22 / 38 / 42 / 45% "
        "(and describe 20 / 36 / 50 / 44%), too slow to meet any target. Cut by condition at "
        "step 2000, every background, outline, edge and format was about equally hard; what "
        "mattered was size (30% right below 40% across, 65% at 60% and over) and time.",
        "- **Auxiliary heads.** So training aids read each one-shape picture straight off the "
        "vision tower (`scripts/toy_aux.py`): linear shape and colour heads on its output "
        "tokens, max-pooled, and a centre head (a score per token, softmaxed over the picture, "
        "weighs the tokens' grid coordinates), their loss added to the answer loss "
        "(`--aux-weight`). The vision tower then learns what the language model has to read "
        "before that model has learned where to look; the heads are dropped at save, so the "
        "checkpoint is a plain Qwen2-VL. With the shape and colour heads alone the monitor "
        "read shape 41 / 41 / 59 / 78% and describe 36 / 48 / 70 / 81% at the same steps, but "
        "position 25 / 22 / 38 / 56% (without heads 25 / 28 / 56 / 81%), and that run ended "
        "with position at 87% (Other runs). With the centre head too: shape 42 / 52 / 69 / 81%, "
        "describe 42 / 56 / 77 / 81%, position 23 / 33 / 55 / 70%, and 96% at the end. A higher "
        "learning rate for the vision tower instead of heads (`--vision-lr-scale 2`) did not "
        "help (shape 36% at step 1000).",
        "- **First or second picture.** Telling the first picture from the second never "
        "emerged while mixed with other questions (not at half the mix for 900 steps, not with "
        '"Picture 1:" labels, not at a rotary base of 100), yet it is learned in 200-750 steps '
        "when one question that needs it makes up the stage (nth_colour or nth_shape), and it "
        "survives the return to the mix. Hence the curriculum: one-picture questions first, "
        "then each two-picture question as a stage of its own, then everything together, which "
        "brings the other answers back.",
        "- **Comparing.** Which image shows a circle? compares a word with each picture, and "
        "Are the two shapes the same colour? compares two pictures; neither emerges in a mix. "
        '"Is the shape a circle?" (yes or no, one picture) at 12% of the first stage stayed at '
        "chance (48-50%) for 2,500 steps. A checkpoint whose which had stalled at 83% confused "
        "circle with square (55%) and star with triangle (70%) while it told round from pointed "
        "shapes (86-97%): which needs the fine shape reading that the per-picture shape question "
        "(nth_shape) trains. Right after nth_shape, which took in four runs of five (650-950 "
        "steps; the fifth had a same-colour stage between nth_colour and nth_shape); without "
        "nth_shape, in one run of four. Same-colour took in all five runs that trained it right "
        "after nth_colour (100-450 steps), and failed in three of the four that trained it right "
        "after which. Which also needs nth_shape kept alive while it learns: from the same "
        "weights (2026-12-03), with only the one-picture questions kept alive nth_shape fell from "
        "91% to 50% in the which stage's first 100 steps and to 11% by its 600th, and which "
        "stayed at chance (47-56%) for 1,100 steps; with nth_shape at a thirteenth of the stage "
        "it stayed at 84-89% and which took in 600 steps (91%). When which falls short it is "
        "nearly always on one pair of look-alike shapes, at chance there and right on the other "
        "five: circle and square or triangle and star in the checkpoint before this one (15 of 59 "
        "and 41 of 68 wrong, 1 of 273 on the rest), square and triangle in a run of 2026-12-03 "
        "(23 of 52, 2 of 348 on the rest). Which pair varies from run to run, and a pair left "
        "at chance by the which stage stayed there through the last mix (27 of 52 wrong with "
        "look-alike pairs three times as often in the mix alone). So the which stage and the "
        "last mix both show look-alike pairs (neighbours in circle, square, triangle, star) "
        "three times as often as the others: from the same weights which then ended its stage "
        "at 92%, and this checkpoint is right on every look-alike pair (0 of 261 wrong on "
        "held-out pictures) but at 72% on square and star (20 of 72).",
        "- **Whether a stage takes.** A stage does not take in the same number of steps from run "
        "to run: nth_shape needed 500 steps in one run and 750 in another. So the stage gate "
        "(`--stage-gate`) lets a stage run on until its held-out monitor says it has taken (at "
        "most `--stage-max-extra` more steps), holding the learning rate where the plan had it; "
        "later stages start that much later and the run grows by as much. When the run's length "
        "was fixed instead, every step a stage ran over came out of the last mix: the checkpoint "
        "before this one got 1,250 of its planned 1,750 mix steps and ended with which at 85%. "
        "Runs differ from machine to machine too: the same command, seed and thread count gave "
        "the same monitor figures on the machines of 2026-12-01 and 2026-12-02, but on that of "
        "2026-12-03 it read describe 39, shape 45 and position 27% at step 500 (before: 42, 42 "
        "and 23%), nth_shape ran 200 steps over where it had run none, and which never took. "
        "The pictures are the same numbers from the same seed; the processor's floating-point "
        "kernels (or the unpinned numpy and Pillow of that day's install) differ, and a "
        "curriculum amplifies any difference. On one machine a run is repeatable: this command "
        "gave the same figures twice there up to the last stage.",
        "- **Turned and small shapes, late.** A shape turned further than any in training is "
        "misread: the checkpoint two before this one, trained on turns of up to 20 degrees, read "
        "30 of 30 upright squares right, 20 at 20 degrees, 10 at 25 and 1 at 40 (triangles 29, "
        "27, 10 and 0, mostly read as stars), and the foreign routine turns shapes by up to 25 "
        "degrees. Wider turns from the start are harder to learn in the same steps: with turns "
        "of up to 30 degrees (60% of shapes) nth_shape did not take in 800 steps (73%) and which "
        "stayed at chance; with 40 degrees the monitor read shape 67% at step 2000, against 81% "
        "at 20 degrees. Taught late they are not: 1,000 steps of the last mix with turns of up "
        "to 40 degrees on 60% of shapes, resumed from the previous checkpoint, read 24 of 27 "
        "squares and 29 of 33 triangles turned by 25 degrees (before: 11 and 14). The foreign "
        "pictures also hold small shapes three times as often as the first stages draw them (30% "
        "under 45% across, against 9.5%), and the previous checkpoint's remaining foreign errors "
        "were mostly small or turned shapes. So the stages before the last draw the easier "
        "pictures and the last mix the wide ones (smaller shapes as often as large, turned "
        "further); 1,500 such steps resumed from the previous checkpoint took foreign shape from "
        "90.5 to 94.5% and small shapes from 93 to 96%. The held-out figures above ask about the "
        "first stages' pictures, as every earlier card did; the wide column shows the harder "
        "ones.",
        "- **Forgetting.** Each one-question stage makes the model forget the answers before it: "
        "every one-picture answer falls to near 0% (it answers the stage's question to "
        "everything), and same-colour fell from 100% to 14% over two later stages in one run. "
        "The last mix brings them back only given time: after 750 mix steps which was at 87% "
        "and same-colour 56%; after 1,400 the two-picture questions met their targets but "
        "describe (91%), shape (94%) and position (92.5%) did not. A few one-picture questions "
        "kept in each two-picture stage (a sixth of it) keep those answers alive: halfway "
        "through this run's which stage describe was at 88%, shape 94% and position 88%. Count, "
        "an extra that is not kept alive and has a small share of the last mix, ends lower "
        "(80%) than it did with the first generator and no stage list (95%).",
        "- **Learning rate.** Holding the peak rate (1e-3) through the one-question stages, "
        "instead of the cosine decay from the start, left which at chance after 1,000 steps "
        "alone; at the ~5e-4 the cosine gives there it learns.",
        "- **Twenty-five minutes.** On the 2-core machine of 2026-12-01 a step cost about "
        "0.24 s in the first stage (batch 24) and in the stages that teach one two-picture "
        "question (batch 16, `--focus-batch-size`), and 0.30 s in the last mix; drawing the "
        "varied pictures cost about 1.5 ms each, a fifth of a first-stage step, and the first "
        "generator's steps 0.18 s. The output layer is applied only where an answer token is "
        "predicted (5% off every step). With the first generator a 6000-step run at batch 24 "
        "throughout took 21.8 minutes and fell short (see Other runs). Machines differ: the "
        "same code, seed and thread count cost 0.43-0.47 s a step on the machine of "
        "2026-12-02 (the checkpoint before this one took 53 minutes there), and 0.18 s in the "
        "first stage, 0.19-0.20 s in the one-question stages and 0.25 s in the last mix on that "
        "of 2026-12-03, where this checkpoint's run took the time under How to reproduce. The "
        "last mix was stretched to 1.6 times its planned 1,750 steps with what that machine "
        "saved.",
        f"- **Rotary base.** The language model's rotary base is {args.rope_theta:g} "
        f"(`rope_theta`; Qwen2-VL uses 10000) and its M-RoPE bands are [{t}, {h}, {w}] (time, "
        f"height, width) of the head's {t + h + w} frequencies, fastest first. M-RoPE hands the "
        "width axis the slowest frequencies: at a base of 10000 they barely turn across a "
        "picture a few tokens wide, and the model could not tell left from right. At a base of "
        "100 the same curriculum learned position about 600 steps later than at 10, and "
        "nothing else faster.",
    ]
    return "\n\n".join(p if p.startswith("#") else textwrap.fill(p, width=96) for p in paragraphs)


def _looks() -> str:
    """What the pictures look like, from the generator's own constants."""
    shares = ", ".join(
        f"{kind} {100 * share:.0f}%"
        for kind, share in zip(BACKGROUNDS, BACKGROUND_SHARES, strict=True)
    )
    text = (
        "Backgrounds are any colour: greys from black to white (30%), tints and pastels such as"
        " beige, light blue or tinted greys (35%), and saturated colours (35%); flat, a linear"
        f" gradient between two such colours, light noise or a faint striped or checked texture"
        f" ({shares}). No background colour comes within {MIN_CONTRAST:.0f} (RGB distance) of a"
        " shape's fill, and a fill is its colour's palette value moved by up to 20 levels a"
        " channel, always still nearest its own name: the answer's colour word stays true."
        " About a third of the pictures outline their shapes (dark, light, or a darker shade of"
        f" the fill, up to {100 * MAX_OUTLINE:.0f}% of the radius wide); 60% have anti-aliased"
        f" edges (4x supersampled), the rest hard ones; shapes may be turned (below); triangles"
        " vary in width and stars in how deep their points are; 40% of the pictures are saved as"
        " JPEG"
        " at quality 60-95 and read back, the rest stay lossless."
    )
    return textwrap.fill(text, width=96)


def _mix(weights: dict[str, float]) -> str:
    total = sum(weights.values())
    return ", ".join(f"{task} {100 * w / total:.0f}%" for task, w in weights.items() if w > 0)


def _variety_text(name: str) -> str:
    """How big and how turned a variety's shapes are, in words."""
    v = VARIETIES[name]
    sizes = "larger more often" if v.skew < 1 else "every size as often"
    alike = (
        f", and the two-picture shape questions pair look-alike shapes (circle and square, square"
        f" and triangle, triangle and star) {v.alike:g} times as often as others"
        if v.alike != 1
        else ""
    )
    return (
        f"{200 * v.smallest:.0f}-{200 * LARGEST_RADIUS:.0f}% of the picture's short side across"
        f" ({sizes}),"
        f" {100 * v.turned:.0f}% of them turned by up to {math.degrees(v.max_angle):.0f} degrees"
        + alike
    )


def _sizes_text(pictures: dict[int, str]) -> str:
    """The sizes and turns of the shapes asked about, stage by stage."""
    names = list(dict.fromkeys(pictures[start] for start in sorted(pictures)))
    if len(names) == 1:
        return f"A shape is {_variety_text(names[0])}, anywhere it fits"
    later = "".join(
        f"; in the stages marked ({n} pictures) below, {_variety_text(n)}"
        for n in names
        if n != FIRST.name
    )
    return f"A shape is {_variety_text(FIRST.name)}, anywhere it fits{later}"


def _curriculum(
    stages: dict[int, dict[str, float]], steps: int, pictures: dict[int, str] | None = None
) -> str:
    """The task mix of each training stage ({first step: full task weights}), in words, with
    the pictures' variety where it is not the first."""
    pictures = pictures or {}
    starts = sorted(stages)
    ends = [*starts[1:], steps]
    return "\n".join(
        f"- steps {start}-{end - 1}: {_mix(stages[start])}"
        + (
            f" ({pictures[start]} pictures)"
            if pictures.get(start, FIRST.name) != FIRST.name
            else ""
        )
        for start, end in zip(starts, ends, strict=True)
    )


def last_stage_extra(args: argparse.Namespace) -> int:
    """Steps the last stage runs past its planned length when stretched (--last-stage-stretch):
    it runs `stretch` times as long, its learning rate decaying as the plan had it."""
    if not args.stage:
        return 0
    last_start = max(int(item.partition(":")[0]) for item in args.stage)
    return round((args.last_stage_stretch - 1) * (args.steps - last_start))


def _steps_run(args: argparse.Namespace, ends: list[StageEnd]) -> int:
    """The planned --steps, the last stage's stretch and every step the gated stages ran past
    their plans."""
    return args.steps + last_stage_extra(args) + sum(end.extra_steps for end in ends)


def _gate_text(args: argparse.Namespace, ends: list[StageEnd]) -> str:
    """How the stages that teach one question were allowed to run on, and how each ended."""
    if args.stage_gate <= 0 or not ends:
        return ""
    outcomes = "; ".join(
        f"{end.task} ended at step {end.step}"
        + (f", {end.extra_steps} steps over plan" if end.extra_steps else ", as planned")
        + f" ({100 * end.accuracy:.0f}%)"
        for end in ends
    )
    text = (
        "A stage that teaches one question (drawn at least three times in four) runs on past"
        " its planned end,"
        f" {STAGE_GATE_EVERY} steps at a time and at most {args.stage_max_extra} steps, until"
        " that question's held-out monitor"
        f" accuracy (64 questions, teacher-forced) reaches {100 * args.stage_gate:.0f}%"
        " (the learning-rate schedule holds meanwhile). Later stages start that much later and"
        " the run grows by as much, so the last mix always gets its planned steps. In this run: "
        + outcomes
        + f"; {_steps_run(args, ends)} steps in all ({args.steps} planned"
        + (
            f", the last stage stretched {args.last_stage_stretch:g} times)."
            if args.last_stage_stretch != 1
            else ")."
        )
    )
    return "\n\n" + textwrap.fill(text, width=96)


def _stages_text(
    stages: dict[int, dict[str, float]] | None,
    args: argparse.Namespace,
    ends: list[StageEnd],
    pictures: dict[int, str] | None = None,
) -> str:
    """The curriculum as it ran: `ends` say how far each gated stage ran past its plan."""
    if stages is None:
        return "The training curriculum is in the command under How to reproduce."
    if len(stages) == 1:
        return f"Every step drew from one mix of questions: {_mix(stages[0])}."
    return (
        "Training is a curriculum: each stage draws its questions in these shares.\n\n"
        + _curriculum(stages, _steps_run(args, ends), pictures)
        + _gate_text(args, ends)
        + _aids_text(stages)
    )


# Why each of our own training-aid questions is there, for the card of a run that trained it.
AIDS = {
    "nth_colour": "reads each picture's colour on its own, which Are the two shapes the same"
    " colour? builds on; it also teaches the language model to tell the first picture from the"
    " second",
    "nth_shape": "reads each picture's shape on its own, which Which image shows a circle?"
    " builds on; it also teaches the language model to tell the first picture from the second",
}


def _extras_text() -> str:
    *rest, last = EXTRA_TASKS
    return f"{', '.join(rest)} and {last}" if rest else last


def _aids_text(stages: dict[int, dict[str, float]]) -> str:
    trained = [t for t in AIDS if any(mix.get(t, 0) > 0 for mix in stages.values())]
    if not trained:
        return ""
    lines = "\n".join(f'- `{t}` ("{TASK_ROWS[t][0]}") {AIDS[t]}.' for t in trained)
    return (
        "\n\nSome questions are not among those this model was built for; they are training"
        " aids (see Why it is trained this way):\n\n" + lines
    )


def _timing(stats: TrainStats | None) -> str:
    if stats is None:
        return "(This card was rewritten by `--eval-only`; see git history for the training time.)"
    return (
        f"Measured: training took {stats.seconds / 60:.1f} minutes with {stats.threads} torch"
        f" thread(s); the busiest 1-minute load average seen meanwhile was {stats.max_load:.1f}"
        " (this process included)."
        + (
            " That is over the ~25 minutes the run is meant to fit in."
            if stats.seconds > 26 * 60
            else ""
        )
    )


def write_model_card(
    out: Path,
    accs: dict[str, float],
    args: argparse.Namespace,
    num_params: int,
    pre: dict,
    stats: TrainStats | None = None,
    stages: dict[int, dict[str, float]] | None = None,
    pictures: dict[int, str] | None = None,
    wide_accs: dict[str, float] | None = None,
) -> None:
    """README.md and accuracy.json for the checkpoint in `out`. `stages` is the training
    curriculum ({first step: task weights}) and `pictures` its varieties ({first step: name}),
    as planned; `wide_accs` the held-out accuracy on the wide pictures, if measured."""
    pictures = stats.pictures if stats else (pictures or {0: FIRST.name})
    wide_head, wide_rule = (" wide pictures |", "---|") if wide_accs else ("", "")
    rows = "\n".join(
        f"| {task} | {TASK_ROWS[task][0]} | {TASK_ROWS[task][1]} | {100 * acc:.1f}% |"
        + (f" {100 * wide_accs[task]:.1f}% |" if wide_accs else "")
        + f" {_target_text(task)} |"
        for task, acc in accs.items()
    )
    positions = ", ".join(p for row in POSITIONS for p in row)
    token_px = (pre["patch_size"] * pre["merge_size"]) ** 2
    min_tokens, max_tokens = pre["min_pixels"] // token_px, pre["max_pixels"] // token_px
    assert set(TASK_ROWS) == set(QUESTIONS)
    text = f"""# mmserve-toy

A **toy** vision-language model: a {num_params / 1e6:.2f}M-parameter Qwen2-VL
(`Qwen2VLForConditionalGeneration`, Hugging Face format, bf16 safetensors) trained from scratch
on synthetic pictures of shapes. It exists so that `mmserve serve` and `LLM()` do something
real with no download, and so that tests have a model whose answers change when the picture
changes. It knows nothing about real images or language beyond the questions below.

## What it was trained on

Pictures generated by `scripts/toy_data.py` and `scripts/toy_render.py`: one shape (or two,
for the counting question); the two-picture questions show two one-shape pictures.
{_looks()}

{_sizes_text(pictures)}; for "Where is the shape?" it is
{200 * CELL_RADIUS[0]:.0f}-{200 * CELL_RADIUS[1]:.0f}% across with its centre well inside one
cell of a 3x3 grid; two-shape pictures hold shapes 24-44% across. Shapes: {", ".join(SHAPES)}.
Colours: {", ".join(COLOURS)}. Picture sizes range from 56 to 448 pixels a side, mostly
small, {100 * NON_SQUARE:.0f}% of them with aspect ratios up to 3:1 either way; the image
processor resizes them to between {pre["min_pixels"]} and {pre["max_pixels"]} pixels
({min_tokens} to {max_tokens} image tokens each). Prompts use the Qwen2-VL chat
template{_labels(args)}, the picture(s) before the question, with the default system prompt
or (one time in four) a random system prompt of up to ~120 plain words. Loss is on the answer
and `<|im_end|>` only. The tokenizer is a 512-token byte-level BPE trained on the same text,
with the Qwen2-VL special tokens and chat template.

{_stages_text(stats.stages if stats else stages, args, stats.stage_ends if stats else [], pictures)}

## What it answers

Answers are exact strings, ending with `<|im_end|>`. Positions use a 3x3 grid: {positions}.

Held-out greedy accuracy ({args.eval_per_task} fresh examples per question, transformers
`generate`, these bf16 weights computed in float32){_wide_note(wide_accs)}:

| task | question | answers | accuracy |{wide_head} target |
|---|---|---|---|{wide_rule}---|
{rows}

The same figures are in `accuracy.json` (machine-readable): mmserve's tests check that the
engine reproduces them on fresh held-out questions (`tests/models/test_toy_model.py`).

Targets: at least 97% on each one-image question, 90% on each two-image one, for the questions
the model is specified to answer; {_extras_text()} are extras of our own (see above).
{_shortfalls(accs)} Ask anything else and the reply is meaningless.

## Pictures drawn by someone else

`scripts/eval_foreign.py` asks the model about pictures from `scripts/foreign_pictures.py`, a
second drawing routine written apart from the training one: numpy point tests instead of
Pillow's rasteriser, equilateral triangles, its own star, turns up to 25 degrees, HSV palette
jitter, outlines measured in pixels, and the backgrounds people use (white, black, grey, beige,
light blue, tinted mid greys, random tints, radial gradients, paper grain, hatching), 112-336
pixels a side, JPEG at quality 55-95 half the time. Greedy answers through mmserve's offline
API (`LLM.chat`):

{FOREIGN_BEGIN}
(not measured yet: run `python scripts/eval_foreign.py --model src/mmserve/models/toy
--per-task 200 --write-card`)
{FOREIGN_END}

{_lessons(args)}

## How to reproduce

```
{_commands(args)}
```

{_timing(stats)} The held-out evaluation afterwards takes a minute or two.
It needs only the development dependencies (transformers and torch); `--device cuda` also
works. Add `--eval-only` to re-measure the accuracy of the checkpoint in `--out` without
training. The run is deterministic for a given seed and thread count (`--threads` above) on
one machine; a different thread count or processor changes floating-point rounding and so the
exact weights (Whether a stage takes).
"""
    (out / "README.md").write_text(text)
    write_accuracy(out, accs, args.eval_per_task, wide_accs)


def _wide_note(wide_accs: dict[str, float] | None) -> str:
    if not wide_accs:
        return ""
    return (
        "; the accuracy column asks about pictures of the first stages' variety, the targets'"
        " held-out set since the first generator, and the next one about the wide pictures of"
        " the last stage (small shapes as often as large, turned further, and look-alike"
        " shapes paired more often in the two-picture shape questions)"
    )


def write_accuracy(
    out: Path, accs: dict[str, float], num_per_task: int, wide_accs: dict[str, float] | None = None
) -> None:
    """accuracy.json: the card's figures, machine-readable, for tests/models/test_toy_model.py."""
    record = {
        "measured_by": (
            "scripts/train_toy_model.py held-out evaluation: transformers greedy generate, "
            f"{num_per_task} fresh examples per task, these bf16 weights computed in float32"
        ),
        "num_per_task": num_per_task,
        "accuracy": {task: round(acc, 4) for task, acc in accs.items()},
    }
    if wide_accs:
        record["wide"] = {task: round(acc, 4) for task, acc in wide_accs.items()}
    (out / "accuracy.json").write_text(json.dumps(record, indent=2) + "\n")
