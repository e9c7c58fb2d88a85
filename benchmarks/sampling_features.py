"""What the OpenAI sampling features cost, side by side in one run on the bundled toy model.

Each variant generates the same number of tokens for the same prompts through the offline
engine (in-process, so the figures are the engine's own work): plain sampling, logprobs with
the top 5, the three penalties with a logit_bias, a JSON-schema grammar, and n=4 against four
separate requests. Variants run interleaved, round after round, and the report gives each
one's median time relative to plain in the same round.

    .venv/bin/python benchmarks/sampling_features.py [--rounds 3] [--prompts 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from mmserve import LLM, SamplingParams, StructuredOutputParams

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue", "yellow", "purple", "orange"]},
        "shape": {"enum": ["circle", "square", "triangle", "star"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["colour", "shape", "count"],
    "additionalProperties": False,
}


def variants(num_tokens: int) -> dict[str, tuple[SamplingParams, int]]:
    """name -> (params, requests per prompt)."""
    base = {"temperature": 1.0, "seed": None, "max_tokens": num_tokens, "ignore_eos": True}
    return {
        "plain": (SamplingParams(**base), 1),
        "logprobs=5": (SamplingParams(**base, logprobs=5), 1),
        "penalties+bias": (
            SamplingParams(
                **base,
                presence_penalty=0.5,
                frequency_penalty=0.5,
                repetition_penalty=1.1,
                logit_bias={7: -5.0, 9: 2.0},
            ),
            1,
        ),
        # a grammar ends its output itself: compare against plain of the same length
        "json_schema": (
            SamplingParams(
                temperature=1.0,
                max_tokens=num_tokens,
                structured_outputs=StructuredOutputParams.json(SCHEMA),
            ),
            1,
        ),
        "n=4": (SamplingParams(**base, n=4), 1),
        "4 requests": (SamplingParams(**base), 4),
    }


def run_variant(llm: LLM, prompts: list[str], params: SamplingParams, copies: int) -> dict:
    start = time.perf_counter()
    outs = llm.generate([p for p in prompts for _ in range(copies)], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"seconds": seconds, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    llm = LLM(enable_prefix_caching=False)  # every variant pays for its own prompts
    prompts = [f"a red circle {i} and a blue square" for i in range(args.prompts)]
    table = variants(args.tokens)
    run_variant(llm, prompts[:4], table["plain"][0], 1)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in table}
    ratios: dict[str, list[float]] = {name: [] for name in table}
    tokens: dict[str, int] = {}
    for _ in range(args.rounds):
        this_round = {}
        for name, (params, copies) in table.items():
            result = run_variant(llm, prompts, params, copies)
            this_round[name] = result["seconds"]
            tokens[name] = result["tokens"]
            seconds[name].append(result["seconds"])
        for name in table:
            ratios[name].append(this_round[name] / this_round["plain"])
    report = {
        name: {
            "median_s": round(statistics.median(seconds[name]), 3),
            "tokens": tokens[name],
            "ms_per_token": round(1000 * statistics.median(seconds[name]) / tokens[name], 3),
            "time_vs_plain": round(statistics.median(ratios[name]), 3),
        }
        for name in table
    }
    print(json.dumps(report, indent=2))
    llm.shutdown()


if __name__ == "__main__":
    main()
