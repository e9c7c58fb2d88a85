"""The compute floor of a serving workload, and how close the server comes to it.

    python benchmarks/compute_floor.py --model DIR                  # the floor alone
    python benchmarks/compute_floor.py --model DIR --serve          # and the server beside it

The floor is the model work alone for the workload of compare_vllm_cpu.py: the same requests
(one 448x448 image + ~32 text tokens, 32 output tokens with EOS ignored; `--workload
repeated-image`: half of them resend an earlier image), run through an in-process engine core
in a tight loop, at most `--concurrency` in flight (a new one is added when one finishes, as
the server's client does), so the scheduler forms the batches the server would. Timers outside
the engine (floor_timers.py) add up the vision tower, the language model in steps with prefill
and in decode-only steps, the logits and the sampling; what `execute` spends beyond them is the
runner's host work (batch preparation, the splice), and what a step spends beyond `execute` is
the scheduler's. The torch intra-op threads are the engine process's (on a CPU every core, idle
threads asleep, unless OMP_NUM_THREADS says otherwise; a small step's language model on one,
as in the server: execution/lm_threads.py). Prompts are processed before the clock starts: that
is the API process's work.

With `--serve` it then starts `mmserve serve` on the same checkpoint and flags, sends the same
requests with `mmserve bench serve`, and reports serving efficiency = floor per request / end-to-
end time per request (the run's wall time / requests completed), with the CPU time each process
spent per request (API process, engine process, decode workers, the client) read from /proc:
where the rest of the time went. `--json FILE` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# The engine process's OpenMP wait policy (cpu_threads.py), before torch loads libgomp
# here: the floor runs with the threads, and the threads' manners, of the server's engine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import floor_serve  # noqa: E402
from ab_workloads import REPEAT_RATIO, WORKLOADS, resolve_dtype  # noqa: E402


@dataclass(frozen=True)
class FloorArgs:
    model: str
    dtype: str
    workload: str
    num_prompts: int
    concurrency: int
    image_size: int
    input_len: int
    output_len: int
    seed: int
    engine_args: tuple[str, ...]  # `mmserve serve` flags, for the core and the server alike


def engine_threads() -> int:
    """The engine process's intra-op threads on a CPU (cpu_threads.py), under the wait
    policy this process was started with (set at the top of this file, as the server does)."""
    from mmserve.cpu_threads import engine_cpu_threads, usable_cpus

    return engine_cpu_threads(1, os.environ, usable_cpus())


def bench_requests(args: FloorArgs, seed: int, num_prompts: int) -> list:
    """The requests `mmserve bench serve` sends for these settings (the same seed: the same
    bytes)."""
    from mmserve.bench.workload import WorkloadConfig, build_workload

    return build_workload(
        WorkloadConfig(
            num_prompts=num_prompts,
            seed=seed,
            image_sizes=((args.image_size, args.image_size),),
            repeat_ratio=REPEAT_RATIO if args.workload == "repeated-image" else 0.0,
            input_len=args.input_len,
            output_len=args.output_len,
        )
    )


def engine_config(args: FloorArgs):
    """The engine of `mmserve serve --model M --dtype D ENGINE_ARGS`, its core in this
    process."""
    import dataclasses

    from mmserve.serve_flags import add_serve_args, serve_configs

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    ns = parser.parse_args(["--model", args.model, "--dtype", args.dtype, *args.engine_args])
    config, _server = serve_configs(ns, {})
    parallel = dataclasses.replace(config.parallel, multiprocess=False)
    return dataclasses.replace(config, parallel=parallel)


def run_closed_loop(core, prompts: list, params, concurrency: int) -> int:
    """Every prompt through the core, at most `concurrency` unfinished; returns steps taken."""
    pending = list(enumerate(prompts))[::-1]
    in_flight: set[str] = set()
    num_steps = 0
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            idx, prompt = pending.pop()
            core.add_request(f"floor-{idx}", prompt, params)
            in_flight.add(f"floor-{idx}")
        for update in core.step():
            if update.finish_status is not None:
                in_flight.discard(update.request_id)
        num_steps += 1
    return num_steps


def measure_floor(args: FloorArgs) -> dict:
    from floor_timers import PHASES, timed_core

    from mmserve import SamplingParams
    from mmserve.engine.factory import build_engine
    from mmserve.execution.lm_threads import intra_op_threads

    threads = engine_threads()
    # the caller's process (a test) is not left with the engine's thread count
    with intra_op_threads(threads):
        engine, _resolved = build_engine(engine_config(args))
        try:
            core, processor = engine.core, engine.input_processor
            params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
            # Warm-up on other images (another seed): lazy initialisation, allocator growth.
            warm = bench_requests(args, args.seed + 7919, min(args.concurrency, 4))
            run_closed_loop(core, [processor.process_chat(r.messages) for r in warm], params, 4)
            requests = bench_requests(args, args.seed, args.num_prompts)
            prompts = [processor.process_chat(r.messages) for r in requests]
            device = next(core.executor.runner.model.parameters()).device
            with timed_core(core, device) as clock:
                started, started_cpu = time.perf_counter(), time.process_time()
                num_steps = run_closed_loop(core, prompts, params, args.concurrency)
                wall_s = time.perf_counter() - started
                loop_cpu_s = time.process_time() - started_cpu
        finally:
            engine.shutdown()
    steps = clock.steps
    phases_s = {p: sum(s.phases_s[p] for s in steps) for p in PHASES}
    phases_cpu_s = {p: sum(s.phases_cpu_s[p] for s in steps) for p in PHASES}
    floor_s = sum(phases_s.values())
    execute_s = sum(s.execute_s for s in steps)
    n = len(prompts)
    return {
        "threads": threads,
        "device": str(device),
        "num_requests": n,
        "num_steps": num_steps,
        "num_prefill_steps": sum(not s.is_decode_only for s in steps if s.num_seqs),
        "num_decode_steps": sum(s.is_decode_only for s in steps),
        "vit_calls": clock.vit_calls,
        "vit_items": clock.vit_items,
        "median_tokens_per_prefill_step": statistics.median(
            [s.num_tokens for s in steps if s.num_seqs and not s.is_decode_only] or [0]
        ),
        "wall_s": wall_s,
        "floor_s": floor_s,
        "phases_s": phases_s,
        "floor_cpu_s": sum(phases_cpu_s.values()),  # CPU seconds of the phases, all threads
        "phases_cpu_s": phases_cpu_s,
        "runner_host_s": execute_s - floor_s,  # batch preparation, the splice, state updates
        "core_overhead_s": wall_s - execute_s,  # scheduling, updates, this loop
        "floor_ms_per_request": 1000 * floor_s / n,
        "floor_cpu_ms_per_request": 1000 * sum(phases_cpu_s.values()) / n,
        "execute_cpu_ms_per_request": 1000 * sum(s.execute_cpu_s for s in steps) / n,
        "loop_cpu_ms_per_request": 1000 * loop_cpu_s / n,
        "loop_ms_per_request": 1000 * wall_s / n,
        "floor_requests_per_s": n / floor_s,
        "loop_requests_per_s": n / wall_s,
    }


def format_floor(floor: dict) -> list[str]:
    n = floor["num_requests"]
    ms = {k: 1000 * v / n for k, v in floor["phases_s"].items()}
    return [
        f"compute floor: {floor['floor_ms_per_request']:.1f} ms/request "
        f"({floor['floor_requests_per_s']:.2f} req/s), {floor['threads']} intra-op thread(s) "
        f"on {floor['device']}, {n} requests in {floor['num_steps']} steps "
        f"({floor['num_prefill_steps']} with prefill, median "
        f"{floor['median_tokens_per_prefill_step']:.0f} tokens; "
        f"{floor['num_decode_steps']} decode-only); {floor['vit_items']} images in "
        f"{floor['vit_calls']} vision-tower calls",
        "  per request: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()),
        f"  CPU time per request: floor {floor['floor_cpu_ms_per_request']:.1f} ms, execute "
        f"{floor['execute_cpu_ms_per_request']:.1f} ms, tight loop "
        f"{floor['loop_cpu_ms_per_request']:.1f} ms (all threads; well under threads x wall "
        "time means the run waited for cores)",
        f"  tight loop: {floor['loop_ms_per_request']:.1f} ms/request "
        f"({floor['loop_requests_per_s']:.2f} req/s); beyond the floor: runner host work "
        f"{1000 * floor['runner_host_s'] / n:.2f} ms, scheduler and core "
        f"{1000 * floor['core_overhead_s'] / n:.2f} ms per request",
    ]


def parse_args(argv: list[str]) -> tuple[FloorArgs, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flag = parser.add_argument
    flag("--model", default="/tmp/mmserve-vllm-cpu/tiny-qwen2vl", help="checkpoint directory")
    flag("--dtype", default="auto", help="auto (as compare_vllm_cpu.py), float32 or bfloat16")
    flag("--workload", choices=WORKLOADS, default="random-mm")
    flag("--num-prompts", type=int, default=48)
    flag("--concurrency", type=int, default=16)
    flag("--image-size", type=int, default=448, help="square images of this side")
    flag("--input-len", type=int, default=32)
    flag("--output-len", type=int, default=32)
    flag("--seed", type=int, default=1016)
    flag("--engine-args", default="", help="extra `mmserve serve` flags, for both runs")
    flag("--serve", action="store_true", help="also measure the server on the same requests")
    flag("--port", type=int, default=8310, help="the server's port with --serve")
    flag("--json", type=Path, default=None, help="write every figure here")
    ns = parser.parse_args(argv)
    if ns.num_prompts < 1 or ns.concurrency < 1:
        parser.error("--num-prompts and --concurrency must be at least 1")
    dtype, _ = resolve_dtype(ns.dtype)
    args = FloorArgs(
        model=ns.model,
        dtype=dtype,
        workload=ns.workload,
        num_prompts=ns.num_prompts,
        concurrency=ns.concurrency,
        image_size=ns.image_size,
        input_len=ns.input_len,
        output_len=ns.output_len,
        seed=ns.seed,
        engine_args=tuple(shlex.split(ns.engine_args)),
    )
    return args, ns


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    args, ns = parse_args(sys.argv[1:] if argv is None else argv)
    _, dtype_reason = resolve_dtype(ns.dtype)
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}",
        "args": {**args.__dict__, "engine_args": list(args.engine_args)},
        "dtype_reason": dtype_reason,
    }
    print(f"dtype {args.dtype} ({dtype_reason}); workload {args.workload}, "
          f"{args.num_prompts} requests at concurrency {args.concurrency}")  # fmt: skip
    result["floor"] = measure_floor(args)
    print("\n".join(format_floor(result["floor"])), flush=True)
    if ns.serve:
        served = floor_serve.measure_server(args, ns.port)
        result["serve"] = served
        result["efficiency"] = floor_serve.efficiency(result["floor"], served)
        print("\n".join(floor_serve.format_serve(result["floor"], served, result["efficiency"])))
    if ns.json is not None:
        ns.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
