"""Ask the toy model about pictures drawn by the foreign routine, through mmserve's offline API.

    python scripts/eval_foreign.py --model src/mmserve/models/toy --per-task 200 --write-card

Prints greedy accuracy per question and, over the one-picture questions, per condition
(background, outline, edges, format, turn, size). With --write-card it stores the figures in
the checkpoint's accuracy.json (under "foreign") and in its model card, between the markers
FOREIGN_BEGIN and FOREIGN_END.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(SCRIPTS), str(SCRIPTS.parent / "src")]

from foreign_pictures import FOREIGN_TASKS, ForeignQuestion, draw_foreign, questions  # noqa: E402
from toy_card import FOREIGN_BEGIN, FOREIGN_END  # noqa: E402

SEED = 424242  # the foreign set's own seed; the tests use another
ONE_PICTURE = ("describe", "colour", "shape", "position")
TARGETS = {"describe": 0.95, "colour": 0.95, "shape": 0.95, "position": 0.90}
TARGETS |= {"which": 0.90, "same_colour": 0.90}


def messages(q: ForeignQuestion) -> list[dict]:
    parts = [{"type": "image", "image": draw_foreign(p)} for p in q.pictures]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": q.question}]}]


def answers(llm, qs: list[ForeignQuestion]) -> list[str]:
    from mmserve import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=12)
    outs = llm.chat([messages(q) for q in qs], greedy, use_tqdm=False)
    return [o.outputs[0].text.strip() for o in outs]


def evaluate(llm, per_task: int, seed: int = SEED) -> dict:
    """{"accuracy": {task: share}, "conditions": {kind: {value: [right, asked]}}}."""
    accuracy, conditions = {}, defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for task in FOREIGN_TASKS:
        qs = questions(task, per_task, seed)
        got = answers(llm, qs)
        right = [g == q.answer for g, q in zip(got, qs, strict=True)]
        accuracy[task] = sum(right) / len(qs)
        if task in ONE_PICTURE:
            for q, hit in zip(qs, right, strict=True):
                for kind, value in q.pictures[0].conditions().items():
                    conditions[kind][value][0] += int(hit)
                    conditions[kind][value][1] += 1
    return {
        "seed": seed,
        "accuracy": accuracy,
        "conditions": {k: dict(v) for k, v in conditions.items()},
    }


def report(result: dict, per_task: int, baseline: dict | None = None) -> str:
    """The model card's foreign section, as markdown."""
    accs = result["accuracy"]
    head = "| task | accuracy | target |" + (" previous checkpoint |" if baseline else "")
    lines = [head, "|---|---|---|" + ("---|" if baseline else "")]
    for task in FOREIGN_TASKS:
        row = f"| {task} | {100 * accs[task]:.1f}% | {100 * TARGETS[task]:.0f}% |"
        if baseline:
            row += f" {100 * baseline['accuracy'][task]:.1f}% |"
        lines.append(row)
    lines += ["", "One-picture questions by condition (right / asked):", ""]
    head = "| condition | this checkpoint |" + (" previous checkpoint |" if baseline else "")
    lines += [head, "|---|---|" + ("---|" if baseline else "")]
    for kind, values in result["conditions"].items():
        for value, (right, asked) in sorted(values.items()):
            row = f"| {kind}: {value} | {right}/{asked} ({100 * right / asked:.0f}%) |"
            if baseline:
                b_right, b_asked = baseline["conditions"][kind].get(value, (0, 0))
                row += f" {b_right}/{b_asked} ({100 * b_right / max(b_asked, 1):.0f}%) |"
            lines.append(row)
    met = [t for t in FOREIGN_TASKS if accs[t] < TARGETS[t]]
    verdict = "Every foreign target is met." if not met else f"Short of target: {', '.join(met)}."
    return f"{per_task} questions per task, seed {result['seed']}. {verdict}\n\n" + "\n".join(lines)


def write_card(model: Path, result: dict, per_task: int, baseline: dict | None) -> None:
    acc_path = model / "accuracy.json"
    data = json.loads(acc_path.read_text())
    data["foreign"] = {"num_per_task": per_task, **result}
    acc_path.write_text(json.dumps(data, indent=2) + "\n")
    card_path = model / "README.md"
    card = card_path.read_text()
    if FOREIGN_BEGIN not in card:
        raise SystemExit(f"{card_path} has no {FOREIGN_BEGIN} marker to write between")
    before, rest = card.split(FOREIGN_BEGIN, 1)
    after = rest.split(FOREIGN_END, 1)[1]
    body = report(result, per_task, baseline)
    card_path.write_text(f"{before}{FOREIGN_BEGIN}\n{body}\n{FOREIGN_END}{after}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--per-task", type=int, default=200)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument(
        "--baseline", type=Path, help="a foreign-results JSON of an earlier checkpoint to compare"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--write-card", action="store_true")
    args = parser.parse_args()
    from mmserve import LLM

    llm = LLM(str(args.model))
    result = evaluate(llm, args.per_task, args.seed)
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    print(report(result, args.per_task, baseline))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.write_card:
        write_card(args.model, result, args.per_task, baseline)


if __name__ == "__main__":
    main()
