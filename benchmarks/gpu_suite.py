"""Every GPU check and benchmark of mmserve in one run (< 9 minutes on one H200), one JSON out.

Sections, in order: environment, measured peaks (bf16 GEMM, bandwidth), the 7B ViT on 1024^2
and 4K images, the Qwen3-VL-8B ViT (head dim 72, patch 16, DeepStack mergers) on 1024^2,
the fused layer ops against torch's, random 2B/7B-shaped checkpoints, decode ms/step at batch
1/8/64 against the weight-read limit (once per attention backend), the same for a random
Qwen3-VL checkpoint at 8B's language-model shape (suite/qwen3_vl.py), greedy
parity with transformers, compare_hf.py at 7B shape, CUDA graphs against eager, torch.compile
against eager (ViT and decode steps, 2B-wide layers, paired A/B: suite/compile_ab.py), decode
throughput at TP=1 and (two GPUs) TP=2 (suite/tensor_parallel.py), every
gpu-marked test (tests/models/test_gpu.py and others) in the time left, and a summary of the
issue's goals. Each section is timed and guarded: one that fails
records its error and the next runs; sections that no longer fit the time budget are skipped
with the reason; the JSON is rewritten after every section, so a run that is cut short still
leaves what it measured.

    bash benchmarks/gpu_install.sh && python benchmarks/gpu_suite.py --out $OUT/gpu_suite.json
    python benchmarks/gpu_suite.py --smoke --out /tmp/smoke.json        # CPU, tiny, seconds
    python benchmarks/gpu_suite.py --sections environment,peaks,vit_q3,decode_q3 \
        --out $OUT/gpu_suite_q3.json                                    # the Qwen3-VL-8B rows
    python benchmarks/gpu_suite.py --sections environment,checkpoints,parity --fp32-parity \
        --out $OUT/parity.json        # is a bf16 divergence at 7B rounding? (fp32 both sides)
    python benchmarks/gpu_suite.py --report gpu_suite.json   # Markdown for benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for entry in (str(REPO / "src"), str(REPO)):
    if entry not in sys.path:
        sys.path.insert(0, entry)

from benchmarks.suite.alarm import Alarm, SectionTimeout  # noqa: E402
from benchmarks.suite.profile import GPU, SMOKE, Profile  # noqa: E402

logger = logging.getLogger("gpu_suite")
# Cheap sections and the goals' figures first: a budget that runs out skips the tail. The gpu
# tests run last, in whatever time is left (up to `gpu_tests_timeout_s`): a pytest run cut
# short reports nothing, and ahead of the goals it could take a third of the budget.
SECTIONS = (
    "environment",
    "peaks",
    "vit",
    "vit_q3",
    "layer_ops",
    "checkpoints",
    "decode",
    "decode_q3",
    "parity",
    "compare_hf",
    "graphs",
    "compile",
    "tensor_parallel",
    "gpu_tests",
)


class NotRunnable(Exception):
    """A section whose inputs an earlier section failed to produce."""


@dataclasses.dataclass(slots=True)
class Run:
    """The state one run carries from section to section (mutable: it accumulates)."""

    profile: Profile
    out_path: Path
    work_dir: Path
    started: float
    results: dict[str, Any]

    def figures(self, name: str) -> dict[str, Any]:
        section = self.results["sections"].get(name, {})
        if section.get("status") != "ok":
            raise NotRunnable(
                f"needs the {name} section, which has status {section.get('status', 'not run')}"
            )
        return section["result"]

    def checkpoint(self, name: str) -> tuple[Path, dict[str, Any]]:
        ckpt = self.figures("checkpoints")[name]
        return Path(ckpt["dir"]), ckpt

    def remaining_s(self) -> float:
        return self.profile.budget_s - (time.perf_counter() - self.started)

    def write(self) -> None:
        from benchmarks.suite.summary import summarize

        names = [c.name for c in self.profile.checkpoints]
        self.results["summary"] = summarize(self.results, names)
        self.results["wall_s"] = time.perf_counter() - self.started
        tmp = self.out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=2, default=str))
        os.replace(tmp, self.out_path)


def section_environment(run: Run) -> dict[str, Any]:
    from benchmarks.suite.environment import describe_environment
    from benchmarks.suite.graphs import graph_fields
    from benchmarks.suite.llm_session import ENGINE_FIELDS, engine_defaults

    env = describe_environment(run.profile.device)
    env["engine_options"] = {
        "attention_backend": "attention_backend" in ENGINE_FIELDS,
        "cuda_graph_fields": graph_fields(),
    }
    env["engine_defaults"] = engine_defaults(run.profile)
    return env


def section_peaks(run: Run) -> dict[str, Any]:
    from benchmarks.suite.peaks import measure_peaks

    return measure_peaks(run.profile)


def _optional(run: Run, name: str) -> dict[str, Any]:
    try:
        return run.figures(name)
    except NotRunnable:
        return {}


def section_vit(run: Run) -> dict[str, Any]:
    from benchmarks.suite.vit import measure_vit

    return measure_vit(run.profile, _optional(run, "peaks").get("gemm", {}).get("tflops"))


def section_vit_q3(run: Run) -> dict[str, Any]:
    from benchmarks.suite.qwen3_vl import measure_vit_q3

    return measure_vit_q3(run.profile, _optional(run, "peaks").get("gemm", {}).get("tflops"))


def section_layer_ops(run: Run) -> dict[str, Any]:
    from benchmarks.suite.layer_ops import measure_layer_ops

    return measure_layer_ops(run.profile)


def section_checkpoints(run: Run) -> dict[str, Any]:
    from benchmarks.suite.checkpoints import write_checkpoints

    return write_checkpoints(run.profile, run.work_dir)


def _limit_ms(run: Run, ckpt: dict[str, Any]) -> float | None:
    gb_per_s = _optional(run, "peaks").get("bandwidth", {}).get("gb_per_s")
    return ckpt["lm_bytes"] / (gb_per_s * 1e9) * 1e3 if gb_per_s else None


def section_decode(run: Run) -> dict[str, Any]:
    from benchmarks.suite.decode import decode_section

    model_dir, ckpt = run.checkpoint("qwen2_vl_7b")
    return decode_section(run.profile, model_dir, ckpt, _optional(run, "peaks"))


def section_decode_q3(run: Run) -> dict[str, Any]:
    from benchmarks.suite.qwen3_vl import decode_q3_section

    return decode_q3_section(run.profile, run.work_dir, _optional(run, "peaks"))


def section_parity(run: Run) -> dict[str, Any]:
    from benchmarks.suite.parity import check_parity

    out: dict[str, Any] = {}
    for spec in run.profile.checkpoints:
        try:
            model_dir, _ = run.checkpoint(spec.name)
            out[spec.name] = check_parity(run.profile, spec, model_dir)
        except Exception as exc:  # one checkpoint failing must not hide the others
            out[spec.name] = {"error": _error(exc)}
    return out


def section_compare_hf(run: Run) -> dict[str, Any]:
    from benchmarks.suite.hf_compare import run_compare_hf

    model_dir, ckpt = run.checkpoint("qwen2_vl_7b")
    return run_compare_hf(run.profile, model_dir, ckpt)


def section_graphs(run: Run) -> dict[str, Any]:
    from benchmarks.suite.graphs import compare_graphs, graph_fields

    if not graph_fields():  # answered without a checkpoint
        return compare_graphs(run.profile, Path(), None)
    model_dir, ckpt = run.checkpoint("qwen2_vl_7b")
    decode = _optional(run, "decode").get("backends", {}).get("triton")
    # The engine runs on images load the 2B: the same 32-block ViT as the 7B, a quarter of the
    # weights to load twice (the tower's graphs at 7B shape are measured alone, as `vit`).
    try:
        image_dir, _ = run.checkpoint("qwen2_vl_2b")
    except (NotRunnable, KeyError):
        image_dir = model_dir
    return compare_graphs(
        run.profile,
        model_dir,
        _limit_ms(run, ckpt),
        decode_with_graphs=decode,
        image_model_dir=image_dir,
    )


def section_compile(run: Run) -> dict[str, Any]:
    from benchmarks.suite.compile_ab import compile_section

    return compile_section(run.profile)


def section_tensor_parallel(run: Run) -> dict[str, Any]:
    from benchmarks.suite.tensor_parallel import measure_tensor_parallel

    model_dir, _ = run.checkpoint("qwen2_vl_2b")
    return measure_tensor_parallel(run.profile, model_dir)


def section_gpu_tests(run: Run) -> dict[str, Any]:
    from benchmarks.suite.gpu_tests import run_gpu_tests

    return run_gpu_tests(max(1.0, min(run.profile.gpu_tests_timeout_s, run.remaining_s())))


SECTION_FUNCTIONS: dict[str, Callable[[Run], dict[str, Any]]] = {
    name: globals()[f"section_{name}"] for name in SECTIONS
}


def _error(exc: BaseException) -> dict[str, str]:
    return {
        "type": type(exc).__name__,
        "message": str(exc)[:2000],
        "traceback": "".join(traceback.format_exception(exc))[-4000:],
    }


def run_section(run: Run, name: str) -> None:
    estimate = run.profile.estimates_s.get(name, 0.0)
    remaining = run.remaining_s()
    entry: dict[str, Any]
    # The environment always runs: figures without the machine and commit are worthless.
    if name != "environment" and (remaining <= estimate or remaining <= 0):
        entry = {
            "status": "skipped",
            "wall_s": 0.0,
            "reason": f"time budget: {remaining:.0f} s "
            f"left of {run.profile.budget_s:.0f} s, section needs ~{estimate:.0f} s",
        }
        run.results["sections"][name] = entry
        logger.info("%s: skipped (%s)", name, entry["reason"])
        return
    logger.info("%s: start (%.0f s left)", name, remaining)
    start = time.perf_counter()
    alarm = Alarm(max(remaining, 30.0 if name == "environment" else 0.1))
    try:
        with alarm:
            entry = {"status": "ok", "result": SECTION_FUNCTIONS[name](run)}
    except NotRunnable as exc:
        entry = {"status": "skipped", "reason": str(exc)}
    except (Exception, SectionTimeout) as exc:
        entry = {"status": "error", "error": _error(exc)}
    if alarm.fired and entry["status"] != "error":
        timeout = SectionTimeout("the time budget ran out; the section's code caught the alarm")
        entry = {"status": "error", "error": _error(timeout)}
    entry["wall_s"] = time.perf_counter() - start
    run.results["sections"][name] = entry
    logger.info("%s: %s in %.1f s", name, entry["status"], entry["wall_s"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="where the JSON goes")
    ap.add_argument(
        "--report", type=Path, help="print an earlier run's JSON as Markdown for RESULTS.md"
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, float32 on the CPU (CI)")
    ap.add_argument("--budget-s", type=float, help="total time budget (default: the profile's)")
    ap.add_argument("--sections", help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--work-dir", type=Path, help="where checkpoints go (default: a temp dir)")
    ap.add_argument(
        "--fp32-parity",
        action="store_true",
        help="also check bf16 against float32 on the largest checkpoints (7B: ~90 s more)",
    )
    args = ap.parse_args(argv)
    if args.report:
        from benchmarks.suite.report import render_markdown

        sys.stdout.write(render_markdown(json.loads(args.report.read_text())))
        return 0
    if args.out is None:
        ap.error("--out is required (or --report to print an earlier run)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    profile = SMOKE if args.smoke else GPU
    if args.budget_s is not None:
        profile = dataclasses.replace(profile, budget_s=args.budget_s)
    if args.fp32_parity:
        specs = tuple(dataclasses.replace(c, check_fp32=True) for c in profile.checkpoints)
        profile = dataclasses.replace(profile, checkpoints=specs)
    if not profile.smoke:
        import torch

        if not torch.cuda.is_available():
            ap.error("no CUDA device: run with --smoke on a CPU machine")
    chosen = SECTIONS if not args.sections else tuple(args.sections.split(","))
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_suite-") as tmp:
        run = Run(
            profile=profile,
            out_path=args.out,
            work_dir=args.work_dir or Path(tmp),
            started=time.perf_counter(),
            results={
                "suite": "gpu_suite",
                "smoke": profile.smoke,
                "budget_s": profile.budget_s,
                "profile": dataclasses.asdict(profile),
                "sections": {},
            },
        )
        for name in chosen:
            run_section(run, name)
            run.write()
    logger.info("wrote %s in %.1f s", args.out, run.results["wall_s"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
