"""Read the result files of an A/B run (mmserve against vLLM and/or a baseline mmserve) and
reduce them to medians and ratios.

Each measured run leaves `vllm bench serve`'s result JSON in the out dir, named
`{engine}-c{concurrency}-r{round}.json`, and beside it `{same stem}.server.json` with what the
harness measured itself (the server's start-up time). Nothing here starts a process; the
functions take paths and values so that tests can feed them small files.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import NamedTuple

VLLM, BASE, CANDIDATE = "vllm", "mmserve-base", "mmserve"  # CANDIDATE: the checkout measured
ENGINES = (VLLM, BASE, CANDIDATE)  # the order in which reports list them
RESULT_NAME = re.compile(
    r"^(?P<engine>vllm|mmserve-base|mmserve)-c(?P<concurrency>\d+)-r(?P<round>\d+)\.json$"
)
# The goal: mmserve's request throughput at least this multiple of vLLM's, and its
# TTFT p50 no higher.
GOAL_THROUGHPUT_RATIO = 1.5


class RunResult(NamedTuple):
    engine: str
    concurrency: int
    round_idx: int
    request_throughput: float  # requests per second
    median_ttft_ms: float
    median_tpot_ms: float
    num_completed: int
    num_prompts: int
    startup_s: float | None  # None when the harness wrote no server file


class ConcurrencySummary(NamedTuple):
    concurrency: int
    num_rounds: dict[str, int]  # engine -> runs found, for every engine of the run
    median_throughput: dict[str, float]
    median_ttft_ms: dict[str, float]
    median_tpot_ms: dict[str, float]
    throughput_ratio: float | None  # mmserve / vllm, of the medians; None: no vLLM (or mmserve)
    base_throughput_ratio: float | None  # mmserve / mmserve-base, of the medians; None: no base
    is_complete: bool  # every request of every run completed
    is_goal_met: bool | None  # None without a ratio against vLLM


def result_stem(engine: str, concurrency: int, round_idx: int) -> str:
    return f"{engine}-c{concurrency}-r{round_idx}"


def load_run(path: Path) -> RunResult:
    """One run from a `vllm bench serve --save-result` file named by `result_stem`."""
    match = RESULT_NAME.match(path.name)
    if match is None:
        raise ValueError(f"{path.name} is not named engine-cN-rM.json")
    data = json.loads(path.read_text())
    server_file = path.with_suffix(".server.json")
    startup_s = json.loads(server_file.read_text())["startup_s"] if server_file.exists() else None
    return RunResult(
        engine=match["engine"],
        concurrency=int(match["concurrency"]),
        round_idx=int(match["round"]),
        request_throughput=float(data["request_throughput"]),
        median_ttft_ms=float(data["median_ttft_ms"]),
        median_tpot_ms=float(data["median_tpot_ms"]),
        num_completed=int(data["completed"]),
        num_prompts=int(data["num_prompts"]),
        startup_s=startup_s,
    )


def load_runs(out_dir: Path) -> list[RunResult]:
    """Every result file in out_dir, ordered by concurrency, round, then vLLM before mmserve."""
    runs = [load_run(p) for p in out_dir.iterdir() if RESULT_NAME.match(p.name)]
    return sorted(runs, key=lambda r: (r.concurrency, r.round_idx, ENGINES.index(r.engine)))


def summarize(runs: list[RunResult]) -> list[ConcurrencySummary]:
    """Per concurrency with results from every engine of the run (every engine with a result at
    any concurrency): medians over rounds, and the ratios of mmserve's medians to vLLM's and to
    the baseline's."""
    engines = engines_of(runs)
    summaries = []
    for concurrency in sorted({r.concurrency for r in runs}):
        by_engine = {
            e: [r for r in runs if (r.concurrency, r.engine) == (concurrency, e)] for e in engines
        }
        if not all(by_engine.values()):
            continue

        def median_of(field: str, by_engine=by_engine) -> dict[str, float]:
            return {
                e: statistics.median(getattr(r, field) for r in rs) for e, rs in by_engine.items()
            }

        throughput, ttft = median_of("request_throughput"), median_of("median_ttft_ms")
        ratio = ratio_of(throughput, VLLM)
        is_complete = all(r.num_completed == r.num_prompts for rs in by_engine.values() for r in rs)
        summaries.append(
            ConcurrencySummary(
                concurrency=concurrency,
                num_rounds={e: len(rs) for e, rs in by_engine.items()},
                median_throughput=throughput,
                median_ttft_ms=ttft,
                median_tpot_ms=median_of("median_tpot_ms"),
                throughput_ratio=ratio,
                base_throughput_ratio=ratio_of(throughput, BASE),
                is_complete=is_complete,
                is_goal_met=None
                if ratio is None
                else is_complete
                and ratio >= GOAL_THROUGHPUT_RATIO
                and ttft[CANDIDATE] <= ttft[VLLM],
            )
        )
    return summaries


def engines_of(runs: list[RunResult]) -> tuple[str, ...]:
    """The engines with any result, in ENGINES order."""
    return tuple(e for e in ENGINES if any(r.engine == e for r in runs))


def ratio_of(throughput: dict[str, float], reference: str) -> float | None:
    """mmserve's median over the reference engine's, when both ran."""
    if CANDIDATE not in throughput or reference not in throughput:
        return None
    return throughput[CANDIDATE] / throughput[reference]


def format_run(run: RunResult) -> str:
    startup = "" if run.startup_s is None else f", start-up {run.startup_s:.0f} s"
    return (
        f"c={run.concurrency} round {run.round_idx} {run.engine:>12}: "
        f"{run.request_throughput:6.2f} req/s, TTFT p50 {run.median_ttft_ms:6.0f} ms, "
        f"TPOT p50 {run.median_tpot_ms:5.1f} ms, completed {run.num_completed}/{run.num_prompts}"
        f"{startup}"
    )


def format_ratio(summary: ConcurrencySummary, reference: str, ratio: float) -> str:
    """One line: mmserve against one reference engine at one concurrency."""
    throughput, ttft = summary.median_throughput, summary.median_ttft_ms
    rounds = min(summary.num_rounds[e] for e in (CANDIDATE, reference))
    return (
        f"c={summary.concurrency}: {CANDIDATE}/{reference} request throughput {ratio:.2f}x "
        f"(medians over {rounds} rounds: "
        f"{CANDIDATE} {throughput[CANDIDATE]:.2f}, {reference} {throughput[reference]:.2f} req/s); "
        f"TTFT p50 {CANDIDATE} {ttft[CANDIDATE]:.0f} ms, {reference} {ttft[reference]:.0f} ms"
    )


def summary_lines(summary: ConcurrencySummary) -> list[str]:
    """Against vLLM (with the goal's verdict) when it ran, then against the baseline when it
    ran; a note on failed requests ends each line."""
    failed = "" if summary.is_complete else "; NOTE: some requests failed, see the runs above"
    lines = []
    if summary.throughput_ratio is not None:
        goal = "met" if summary.is_goal_met else "not met"
        lines.append(
            f"{format_ratio(summary, VLLM, summary.throughput_ratio)}; "
            f"goal (>= {GOAL_THROUGHPUT_RATIO}x, TTFT no worse) {goal}{failed}"
        )
    if summary.base_throughput_ratio is not None:
        lines.append(f"{format_ratio(summary, BASE, summary.base_throughput_ratio)}{failed}")
    if not lines:
        lines.append(f"c={summary.concurrency}: no {CANDIDATE} result to compare")
    return lines


def format_summary(summary: ConcurrencySummary) -> str:
    return "\n".join(summary_lines(summary))


def write_summary(path: Path, runs: list[RunResult], context: dict) -> list[ConcurrencySummary]:
    """Write runs, per-concurrency medians and the caller's context (versions, flags) as JSON."""
    summaries = summarize(runs)
    document = {
        **context,
        "runs": [r._asdict() for r in runs],
        "by_concurrency": [s._asdict() for s in summaries],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    return summaries


def report(runs: list[RunResult]) -> list[str]:
    """The lines the harness prints at the end: every run, then per concurrency one line per
    comparison."""
    lines = [format_run(r) for r in runs]
    summaries = summarize(runs)
    lines += [line for s in summaries for line in summary_lines(s)]
    covered = {s.concurrency for s in summaries}
    engines = engines_of(runs)
    for c in sorted({r.concurrency for r in runs} - covered):
        missing = [e for e in engines if not any((r.concurrency, r.engine) == (c, e) for r in runs)]
        lines.append(f"c={c}: incomplete, no result from {', '.join(missing)}")
    return lines
