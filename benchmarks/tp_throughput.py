"""Offline throughput of one workload at several --tensor-parallel-size values (issue #34).

    python benchmarks/tp_throughput.py --model DIR --tp 1 2 [--num-prompts 16 --max-tokens 64]

The same prompts each time (one picture and a question each, greedy, a fixed number of
tokens): generated tokens per second after a warm-up, and whether every size gave the same
tokens as the first. On a CPU this is for the record only: the ranks share the same cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for entry in (str(REPO / "src"), str(REPO)):
    if entry not in sys.path:
        sys.path.insert(0, entry)

from tests.support.factory import random_image  # noqa: E402

from mmserve import LLM, SamplingParams  # noqa: E402

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def _prompts(n: int) -> list[dict]:
    return [
        {
            "prompt": f"<|im_start|>user\n{IMG}Picture {i}: what is in it?<|im_end|>\n"
            "<|im_start|>assistant\n",
            "multi_modal_data": {"image": random_image(112, 112, seed=i)},
        }
        for i in range(n)
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--multiprocess",
        action="store_true",
        help="the engine core in its own process (as `serve` runs it), also at TP=1",
    )
    args = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = _prompts(args.num_prompts)
    rows, first = [], None
    for tp in args.tp:
        engine = {"tensor_parallel_size": tp, "multiprocess": args.multiprocess}
        with LLM(model=args.model, kv_cache_memory_bytes=64 << 20, **engine) as llm:
            llm.generate(_prompts(2)[::-1], params, use_tqdm=False)  # warm-up, other pictures
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in outputs]
        first = tokens if first is None else first
        num = sum(len(t) for t in tokens)
        rows.append(
            {
                "tensor_parallel_size": tp,
                "multiprocess": args.multiprocess,
                "seconds": round(seconds, 2),
                "output_tok_per_s": round(num / seconds, 1),
                "same_tokens_as_first": tokens == first,
            }
        )
        print(json.dumps(rows[-1]), flush=True)  # noqa: T201 - a script's output
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
