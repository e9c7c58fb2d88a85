"""The bundled toy model on every available device and dtype: answers, agreement, speed.

CPU float32 is the reference path (the one checked against transformers); each other
(device, dtype) runs the same held-out toy questions through the offline engine and reports
accuracy, agreement with the reference answers and wall time. Run on a GPU machine:

    PYTHONPATH=src:. python benchmarks/gpu_smoke.py [--per-task 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.toy_examples import TASKS, held_out  # noqa: E402

from mmserve import LLM, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def run(device: str, dtype: str, questions) -> dict:
    llm = LLM(device=device, dtype=dtype)
    llm.chat(questions[0].messages(), GREEDY, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.chat([q.messages() for q in questions], GREEDY, use_tqdm=False)
    seconds = time.perf_counter() - start
    answers = [o.outputs[0].text.strip() for o in outs]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"device": device, "dtype": dtype, "seconds": seconds, "tok_per_s": tokens / seconds,
            "answers": answers}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-task", type=int, default=20)
    ap.add_argument("--result-json", type=Path)
    args = ap.parse_args()
    questions = [q for task in TASKS for q in held_out(task, args.per_task, seed=11)]
    configs = [("cpu", "float32")]
    if torch.cuda.is_available():
        configs += [("cuda", "float32"), ("cuda", "bfloat16")]
        print("device:", torch.cuda.get_device_name(0))
    results = [run(d, t, questions) for d, t in configs]
    reference = results[0]["answers"]
    for r in results:
        correct = sum(a == q.answer for a, q in zip(r["answers"], questions, strict=True))
        agree = sum(a == b for a, b in zip(r["answers"], reference, strict=True))
        r.update(accuracy=correct / len(questions), agreement_with_cpu=agree / len(questions))
        print(f"{r['device']:5} {r['dtype']:9} {len(questions)} questions in {r['seconds']:.2f} s "
              f"({r['tok_per_s']:.0f} tok/s), accuracy {r['accuracy']:.3f}, "
              f"agreement with cpu float32 {r['agreement_with_cpu']:.3f}")  # fmt: skip
    if args.result_json:
        args.result_json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
