"""Side-by-side serving benchmark on CPU: `vllm serve` (vllm-cpu 0.32) against `mmserve serve`.

    python benchmarks/compare_vllm_cpu.py setup        # build the vLLM venv (kept if it works)
    python benchmarks/compare_vllm_cpu.py model        # write the tiny random Qwen2-VL
    python benchmarks/compare_vllm_cpu.py run          # both of the above when needed, then A/B
    python benchmarks/compare_vllm_cpu.py summarize OUT_DIR

Run it with any Python 3.11 (it imports only the standard library and its sibling files).
`run` serves one checkpoint with each engine in turn, one server at a time, and drives both with
the same load generator, vLLM's own `vllm bench serve`: random-mm requests of one 448x448 image
and 32 text tokens, 32 output tokens with EOS ignored, all sent at once behind a concurrency
cap. For every concurrency it runs ROUNDS rounds of A (vLLM) then B (mmserve), a fresh server
each time and the round number as the workload seed, so both engines get the same requests and
slow drift of the machine hits both. It prints each run and then, per concurrency, the median
request throughput ratio mmserve/vLLM and both TTFT p50 medians; summary.json in the out dir has
every figure.

Settings come from the environment (or the flag of the same name in lower case, `--rounds 1`):

    VLLM_ROOT       where the venv, the checkpoint and the runs live   /tmp/mmserve-vllm-cpu
    ROUNDS          A/B rounds per concurrency                         2
    CONCURRENCIES   space-separated concurrency caps                   16 (full report: 1 16 64)
    NUM_PROMPTS     requests per run                                   48
    VLLM_PORT, MMSERVE_PORT                                            8301, 8302
    MMSERVE_PY      python of a venv with mmserve installed            this repo's .venv/bin/python
    MMSERVE_ARGS    extra flags for `mmserve serve`; VLLM_ARGS the same for `vllm serve`
    OUT_DIR         where results go                                   VLLM_ROOT/runs/<date-time>
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import ab_summary
import vllm_cpu_venv
from server_process import log_tail, running_server

log = logging.getLogger("compare_vllm_cpu")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# The workload, as `vllm bench serve` flags; --num-prompts, --max-concurrency and --seed vary.
WORKLOAD_FLAGS = [
    "--dataset-name", "random-mm",
    "--random-input-len", "32",
    "--random-output-len", "32",
    "--random-range-ratio", "0",
    "--random-mm-base-items-per-request", "1",
    "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
    "--random-mm-bucket-config", "{(448, 448, 1): 1.0}",
    "--request-rate", "inf",
    "--ignore-eos",
]  # fmt: skip
BENCH_TIMEOUT_S = 1800
# Everything is local: no model hub look-ups, no usage reports (this machine reaches neither).
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


class HarnessError(RuntimeError):
    """Something the harness cannot carry on from; the message says what and where to look."""


@dataclass(frozen=True)
class Settings:
    vllm_root: Path
    out_dir: Path
    rounds: int
    concurrencies: tuple[int, ...]
    num_prompts: int
    vllm_port: int
    mmserve_port: int
    mmserve_py: str
    mmserve_args: tuple[str, ...]
    vllm_args: tuple[str, ...]
    startup_timeout_s: float

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.num_prompts < 1:
            raise ValueError("ROUNDS and NUM_PROMPTS must be at least 1")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError('CONCURRENCIES must list positive integers, e.g. "1 16 64"')
        if self.vllm_port == self.mmserve_port:
            raise ValueError("VLLM_PORT and MMSERVE_PORT must differ")

    @property
    def venv(self) -> Path:
        return self.vllm_root / "venv"

    @property
    def model_dir(self) -> Path:
        return self.vllm_root / "tiny-qwen2vl"


def ensure_model(settings: Settings) -> Path:
    """Write the checkpoint with the vLLM venv's python unless a complete one is there."""
    model = settings.model_dir
    if (model / "model.safetensors").exists():
        log.info("checkpoint %s already there", model)
        return model
    partial = model.with_name(model.name + ".partial")  # renamed only once fully written
    python = settings.venv / "bin" / "python"
    cmd = [str(python), str(HERE / "make_tiny_qwen2vl.py"), str(partial)]
    if subprocess.run(cmd).returncode != 0:
        raise HarnessError(f"writing the checkpoint failed: {shlex.join(cmd)}")
    partial.rename(model)
    return model


def vllm_command(settings: Settings, model: Path) -> tuple[list[str], dict[str, str]]:
    cmd = [
        str(settings.venv / "bin" / "vllm"), "serve", str(model),
        "--host", "127.0.0.1", "--port", str(settings.vllm_port),
        "--limit-mm-per-prompt", '{"image": 1}',
        # On CPU this is the share of host memory vLLM reserves up front.
        "--gpu-memory-utilization", "0.3",
        *settings.vllm_args,
    ]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}  # GiB
    return cmd, env


def mmserve_command(settings: Settings, model: Path) -> tuple[list[str], dict[str, str]]:
    cmd = [
        settings.mmserve_py, "-m", "mmserve", "serve", "--model", str(model),
        # vLLM names the model by its path; the bench sends that name to both servers.
        "--served-model-name", str(model),
        "--host", "127.0.0.1", "--port", str(settings.mmserve_port),
        *settings.mmserve_args,
    ]  # fmt: skip
    return cmd, {}


def run_bench(
    settings: Settings, model: Path, port: int, concurrency: int, stem: str, seed: int
) -> None:
    cmd = [
        str(settings.venv / "bin" / "vllm"), "bench", "serve",
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", f"http://127.0.0.1:{port}", "--model", str(model), "--tokenizer", str(model),
        *WORKLOAD_FLAGS,
        "--num-prompts", str(settings.num_prompts), "--max-concurrency", str(concurrency),
        "--seed", str(seed), "--disable-tqdm",
        "--save-result", "--result-dir", str(settings.out_dir), "--result-filename", f"{stem}.json",
    ]  # fmt: skip
    bench_log = settings.out_dir / f"{stem}.bench.log"
    with bench_log.open("w") as log_file:
        done = subprocess.run(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE_ENV},
            timeout=BENCH_TIMEOUT_S,
        )  # fmt: skip
    if done.returncode != 0 or not (settings.out_dir / f"{stem}.json").exists():
        raise HarnessError(
            f"vllm bench serve failed (code {done.returncode}); end of {bench_log}:\n"
            f"{log_tail(bench_log)}"
        )


def workload_seed(concurrency: int, round_idx: int) -> int:
    """Distinct per (round, concurrency): no run resends an earlier run's images, so a server
    kept up across concurrencies gets no cache hit a fresh one would not."""
    return 1000 * round_idx + concurrency


def measure_round(
    settings: Settings, engine: str, model: Path, round_idx: int
) -> list[ab_summary.RunResult]:
    """One server of `engine`, started fresh, benchmarked at every concurrency, then stopped
    (vLLM's start-up is minutes: one per round, not one per run)."""
    make_command = vllm_command if engine == "vllm" else mmserve_command
    cmd, env = make_command(settings, model)
    port = settings.vllm_port if engine == "vllm" else settings.mmserve_port
    server_log = settings.out_dir / f"{engine}-r{round_idx}.server.log"
    env = {**os.environ, **OFFLINE_ENV, **env}
    results = []
    with running_server(
        engine, cmd, env, port, server_log, settings.startup_timeout_s
    ) as startup_s:
        log.info("%s healthy after %.0f s", engine, startup_s)
        for concurrency in settings.concurrencies:
            stem = ab_summary.result_stem(engine, concurrency, round_idx)
            log.info("%s round %d: benchmarking c=%d", engine, round_idx, concurrency)
            seed = workload_seed(concurrency, round_idx)
            run_bench(settings, model, port, concurrency, stem, seed=seed)
            server_json = settings.out_dir / f"{stem}.server.json"
            server_json.write_text(json.dumps({"startup_s": startup_s}))
            results.append(ab_summary.load_run(settings.out_dir / f"{stem}.json"))
            print(ab_summary.format_run(results[-1]), flush=True)
    return results


def mmserve_location(settings: Settings) -> str:
    """Where MMSERVE_PY imports mmserve from (so a report says which checkout it measured)."""
    if not Path(settings.mmserve_py).exists():
        raise HarnessError(
            f"MMSERVE_PY={settings.mmserve_py} does not exist; "
            "point it at the python of a venv with mmserve installed"
        )
    where = subprocess.run(
        [settings.mmserve_py, "-c", "import mmserve; print(mmserve.__file__)"],
        capture_output=True, text=True,
    )  # fmt: skip
    if where.returncode != 0:
        raise HarnessError(
            f"MMSERVE_PY={settings.mmserve_py} cannot import mmserve:\n{where.stderr[-2000:]}"
        )
    return where.stdout.strip()


def run_context(settings: Settings, vllm_version: str, mmserve_path: str) -> dict:
    settings_dict = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()}
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}",
        "vllm": vllm_version,
        "mmserve": mmserve_path,
        "settings": settings_dict,
        "workload": WORKLOAD_FLAGS,
    }


def run(settings: Settings) -> int:
    mmserve_path = mmserve_location(settings)
    vllm_version = vllm_cpu_venv.ensure_vllm_venv(settings.venv)
    model = ensure_model(settings)
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    context = run_context(settings, vllm_version, mmserve_path)
    log.info("results in %s; mmserve from %s", settings.out_dir, mmserve_path)
    runs = []
    try:
        for round_idx in range(1, settings.rounds + 1):
            for engine in ab_summary.ENGINES:
                runs.extend(measure_round(settings, engine, model, round_idx))
    finally:  # a run that stops early still leaves the summary of what it measured
        if runs:
            ab_summary.write_summary(settings.out_dir / "summary.json", runs, context)
            print("\n== all runs, then medians per concurrency ==")
            print("\n".join(ab_summary.report(runs)))
            print(f"summary: {settings.out_dir / 'summary.json'}")
    return 0


def parse_args(argv: list[str], environ: dict[str, str]) -> argparse.Namespace:
    """The command line; each flag's default is the environment variable of the same name."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["setup", "model", "run", "summarize"])
    parser.add_argument("summary_dir", nargs="?", type=Path, help="summarize: a run's out dir")
    flag = parser.add_argument
    flag("--vllm-root", type=Path, default=environ.get("VLLM_ROOT", "/tmp/mmserve-vllm-cpu"))
    flag("--out-dir", type=Path, default=environ.get("OUT_DIR"))
    flag("--rounds", type=int, default=environ.get("ROUNDS", "2"))
    flag("--concurrencies", default=environ.get("CONCURRENCIES", "16"))
    flag("--num-prompts", type=int, default=environ.get("NUM_PROMPTS", "48"))
    flag("--vllm-port", type=int, default=environ.get("VLLM_PORT", "8301"))
    flag("--mmserve-port", type=int, default=environ.get("MMSERVE_PORT", "8302"))
    flag("--mmserve-py", default=environ.get("MMSERVE_PY", str(REPO / ".venv" / "bin" / "python")))
    flag("--mmserve-args", default=environ.get("MMSERVE_ARGS", ""))
    flag("--vllm-args", default=environ.get("VLLM_ARGS", ""))
    flag("--startup-timeout-s", type=float, default=environ.get("STARTUP_TIMEOUT_S", "600"))
    args = parser.parse_args(argv)
    if args.command == "summarize" and args.summary_dir is None:
        parser.error("summarize needs the out dir of a run")
    return args


def settings_from(args: argparse.Namespace) -> Settings:
    vllm_root = Path(args.vllm_root)
    return Settings(
        vllm_root=vllm_root,
        out_dir=Path(args.out_dir or vllm_root / "runs" / time.strftime("%Y%m%d-%H%M%S")),
        rounds=args.rounds,
        concurrencies=tuple(int(c) for c in args.concurrencies.split()),
        num_prompts=args.num_prompts,
        vllm_port=args.vllm_port,
        mmserve_port=args.mmserve_port,
        mmserve_py=args.mmserve_py,
        mmserve_args=tuple(shlex.split(args.mmserve_args)),
        vllm_args=tuple(shlex.split(args.vllm_args)),
        startup_timeout_s=args.startup_timeout_s,
    )


def exit_on_signal(signum: int, _frame) -> None:
    # SystemExit unwinds through running_server's `finally`, which stops the server.
    log.error("%s: stopping", signal.Signals(signum).name)
    raise SystemExit(128 + signum)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, exit_on_signal)
    try:
        args = parse_args(sys.argv[1:], dict(os.environ))
        if args.command == "summarize":
            runs = ab_summary.load_runs(args.summary_dir)
            if not runs:
                raise HarnessError(f"no engine-cN-rM.json result files in {args.summary_dir}")
            print("\n".join(ab_summary.report(runs)))
            return 0
        settings = settings_from(args)
        if args.command == "run":
            return run(settings)
        vllm_cpu_venv.ensure_vllm_venv(settings.venv)
        if args.command == "model":
            print(ensure_model(settings))
    except (ValueError, RuntimeError, subprocess.SubprocessError) as e:
        log.error("%s", e)
        return 1
    except KeyboardInterrupt:
        log.error("interrupted; servers stopped")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
