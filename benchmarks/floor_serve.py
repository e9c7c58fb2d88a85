"""The server side of compute_floor.py: `mmserve serve` on the same requests, with the CPU time
of each of its processes (and of the client) per request, read from /proc."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ab_workloads import REPEAT_RATIO
from server_process import ServerError, is_port_open, stop_server, wait_until_healthy

STARTUP_TIMEOUT_S = 600
BENCH_TIMEOUT_S = 1800
TICKS_PER_S = os.sysconf("SC_CLK_TCK")
ENGINE_MODULE = "mmserve.engine.core.process"
ROLES = ("api", "engine", "decode_workers")


def process_cpu_s(pid: int) -> float:
    """utime + stime of one process, in seconds (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # fields 14, 15 of stat


def role_of(pid: int, server_pid: int) -> str:
    if pid == server_pid:
        return "api"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "decode_workers"
    return "engine" if ENGINE_MODULE in cmdline else "decode_workers"


def process_tree(root: int) -> list[int]:
    """`root` and every live process descended from it (the engine process and the decode
    workers are the API process's children, whatever session they run in)."""
    parent_of: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, ...
            if fields[0] != "Z":
                parent_of[int(stat.parent.name)] = int(fields[1])
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parent_of.items() if parent in frontier]
        tree.extend(frontier)
    return tree


def cpu_by_role(server_pid: int) -> dict[str, float]:
    """CPU seconds so far of the server's processes, summed by role."""
    totals = dict.fromkeys(ROLES, 0.0)
    for pid in process_tree(server_pid):
        totals[role_of(pid, server_pid)] += process_cpu_s(pid)
    return totals


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@contextlib.contextmanager
def mmserve_server(args, port: int, log_path: Path) -> Iterator[int]:
    """`mmserve serve` as compare_vllm_cpu.py starts it; yields its pid once healthy."""
    if is_port_open(port):
        raise ServerError(f"port {port} is already in use; choose another with --port")
    cmd = [
        sys.executable, "-m", "mmserve", "serve", "--model", args.model,
        "--served-model-name", args.model, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", args.dtype, *args.engine_args,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        wait_until_healthy("mmserve", proc, port, log_path, STARTUP_TIMEOUT_S)
        yield proc.pid
    finally:
        stop_server(proc, grace_s=30)


def run_bench(args, port: int, seed: int, num_prompts: int, out: Path) -> dict:
    """`mmserve bench serve` with the floor's workload; its result JSON."""
    cmd = [
        sys.executable, "-m", "mmserve", "bench", "serve",
        "--base-url", f"http://127.0.0.1:{port}", "--model", args.model,
        "--image-sizes", f"{args.image_size}x{args.image_size}", "--images-per-request", "1",
        "--repeat-ratio", str(REPEAT_RATIO if args.workload == "repeated-image" else 0.0),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--ignore-eos", "--request-rate", "inf", "--max-concurrency", str(args.concurrency),
        "--num-prompts", str(num_prompts), "--seed", str(seed), "--disable-tqdm",
        "--no-server-metrics", "--result-json", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"mmserve bench serve failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(out.read_text())


def measure_server(args, port: int) -> dict:
    """Warm the server up on other images, then send the floor's requests (the bench's seed
    and settings give the very requests compute_floor.bench_requests built); CPU per process
    over the measured run only."""
    with tempfile.TemporaryDirectory(prefix="compute-floor-") as tmp:
        tmp_dir = Path(tmp)
        with mmserve_server(args, port, tmp_dir / "server.log") as pid:
            run_bench(args, port, args.seed + 7919, min(args.concurrency, 4), tmp_dir / "w.json")
            before, client_before = cpu_by_role(pid), children_cpu_s()
            result = run_bench(args, port, args.seed, args.num_prompts, tmp_dir / "run.json")
            after, client_after = cpu_by_role(pid), children_cpu_s()
    cpu_s = {role: after[role] - before[role] for role in ROLES}
    cpu_s["client"] = client_after - client_before  # its python start-up included
    return {
        "completed": result["completed"],
        "num_requests": result["num_requests"],
        "duration_s": result["duration_s"],
        "request_throughput": result["request_throughput"],
        "ttft_p50_ms": (result.get("ttft") or {}).get("p50_ms"),
        "cpu_s": cpu_s,
        "cpu_ms_per_request": {k: 1000 * v / max(1, result["completed"]) for k, v in cpu_s.items()},
        "busy_share": {k: v / result["duration_s"] for k, v in cpu_s.items()},
    }


def efficiency(floor: dict, served: dict) -> dict:
    """Serving efficiency = floor per request / end-to-end time per request (both wall time:
    compare them on a quiet machine); the engine process's CPU per request beyond the floor's
    CPU time (what the serving path adds in that process, robust to a loaded machine)."""
    e2e_ms = 1000 * served["duration_s"] / max(1, served["completed"])
    engine_ms = served["cpu_ms_per_request"]["engine"]
    return {
        "e2e_ms_per_request": e2e_ms,
        "serving_efficiency": floor["floor_ms_per_request"] / e2e_ms,
        "tight_loop_efficiency": floor["floor_ms_per_request"] / floor["loop_ms_per_request"],
        "engine_cpu_beyond_floor_ms": engine_ms - floor["floor_cpu_ms_per_request"],
        # what the serving path adds in the engine process: the wire, the loop, its sends
        "engine_cpu_beyond_tight_loop_ms": engine_ms - floor["loop_cpu_ms_per_request"],
    }


def format_serve(floor: dict, served: dict, eff: dict) -> list[str]:
    per = served["cpu_ms_per_request"]
    busy = served["busy_share"]
    return [
        f"server: {served['request_throughput']:.2f} req/s "
        f"({served['completed']}/{served['num_requests']} completed), "
        f"{eff['e2e_ms_per_request']:.1f} ms/request end to end, TTFT p50 "
        f"{served['ttft_p50_ms'] or float('nan'):.0f} ms",
        f"serving efficiency (floor / end to end): {eff['serving_efficiency']:.0%}; "
        f"the in-process tight loop reaches {eff['tight_loop_efficiency']:.0%}",
        "  CPU per request, by process (share of the run's wall time busy): "
        + ", ".join(f"{k} {per[k]:.1f} ms ({busy[k]:.0%})" for k in per),
        f"  engine process beyond the floor: {eff['engine_cpu_beyond_floor_ms']:.1f} ms CPU "
        f"per request (its CPU {served['cpu_ms_per_request']['engine']:.1f} ms, the floor's "
        f"{floor['floor_cpu_ms_per_request']:.1f} ms), beyond the tight loop: "
        f"{eff['engine_cpu_beyond_tight_loop_ms']:.1f} ms",
    ]
