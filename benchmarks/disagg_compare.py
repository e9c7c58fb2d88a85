"""`mmserve serve` alone (A) against `mmserve serve --encoder-urls` + 2 `mmserve encode` (B).

    python benchmarks/disagg_compare.py [--out-dir DIR] [--rounds 2] [--num-prompts 32] ...
    python benchmarks/disagg_compare.py --report DIR/disagg_compare.json

Run it with the python of a venv that has mmserve (it drives `python -m mmserve` with the same
interpreter and environment, and rebuilds the bench's workload to count image tokens). It writes
(or reuses) a tiny random Qwen2-VL with make_tiny_qwen2vl.py in the out dir, then for every
round starts each deployment fresh (A then B in odd rounds, B then A in even ones, so drift of
the machine hits both), warms it up, and runs `mmserve bench serve` once per workload (one per
--images-per-request value), scraping every server's /metrics before and after. A and B of one
round and workload get the same seed, so the same requests; no server ever sees an image twice
(fresh processes every round, another seed for every round, workload and warm-up). Each
process has fresh ports in --base-port .. --base-port + 99 and its log in the out dir. The JSON
is rewritten after every run; the Markdown section (disagg_report.py) is printed at the end.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import itertools
import json
import logging
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import disagg_report
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerError, is_port_open, log_tail, running_server

from mmserve.bench.workload import WorkloadConfig, build_synthetic, parse_image_sizes

log = logging.getLogger("disagg_compare")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NUM_ENCODERS = 2
NUM_PORTS = 100
BENCH_TIMEOUT_S = 600
WARMUP_PROMPTS = 4


@dataclass(frozen=True)
class Settings:
    out_dir: Path
    model_dir: Path | None  # None: write the tiny checkpoint into out_dir
    rounds: int
    num_prompts: int
    max_concurrency: int
    image_sizes: tuple[tuple[int, int], ...]
    images_per_request: tuple[int, ...]  # one workload each
    input_len: int
    output_len: int
    dtype: str
    base_port: int
    serve_args: tuple[str, ...]
    startup_timeout_s: float

    def __post_init__(self) -> None:
        if self.rounds < 2:
            raise ValueError("--rounds must be at least 2: A and B interleave over rounds")
        if min(self.num_prompts, self.max_concurrency, self.output_len) < 1:
            raise ValueError("--num-prompts, --max-concurrency and --output-len must be >= 1")
        if not self.images_per_request or min(self.images_per_request) < 1:
            raise ValueError('--images-per-request must list positive integers, e.g. "1,2"')
        if self.dtype not in disagg_report.DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {', '.join(disagg_report.DTYPE_BYTES)}")


class Ports:
    """Fresh ports for every process: a stopped server's port is never reused in one run."""

    def __init__(self, base: int) -> None:
        self._next = itertools.count(base)
        self._limit = base + NUM_PORTS

    def take(self) -> int:
        port = next(self._next)
        if port >= self._limit:
            raise ValueError(f"out of ports: lower --rounds, or move --base-port ({NUM_PORTS})")
        if is_port_open(port):
            raise ServerError(f"port {port} is already in use; move --base-port")
        return port


def ensure_model(settings: Settings) -> Path:
    """The given checkpoint, or the tiny one in the out dir (written once, reused after)."""
    if settings.model_dir is not None:
        return settings.model_dir
    model = settings.out_dir / "tiny-qwen2vl"
    if (model / "model.safetensors").exists():
        log.info("checkpoint %s already there", model)
        return model
    partial = model.with_name(model.name + ".partial")  # renamed only once fully written
    cmd = [sys.executable, str(HERE / "make_tiny_qwen2vl.py"), str(partial), "--no-check"]
    if subprocess.run(cmd).returncode != 0:
        raise RuntimeError(f"writing the checkpoint failed: {shlex.join(cmd)}")
    partial.rename(model)
    return model


def scrape(port: int) -> dict[str, float]:
    """Every sample of GET /metrics by name and labels (model_name dropped), no timestamps."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = ",".join(
                f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name"
            )
            samples[s.name + (f"{{{labels}}}" if labels else "")] = float(s.value)
    return samples


def total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def by_label(samples: dict[str, float], name: str, label: str) -> dict[str, float]:
    prefix = f'{name}{{{label}="'
    return {k[len(prefix) :].split('"')[0]: v for k, v in samples.items() if k.startswith(prefix)}


def scrape_settled(port: int, max_wait_s: float = 5.0) -> dict[str, float]:
    """Read until the server is idle and two reads agree: the engine publishes its counters a
    step after the last response went out."""

    def counters(samples: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in samples.items() if k.startswith("mmserve_") and "_total" in k}

    deadline = time.monotonic() + max_wait_s
    last = scrape(port)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = scrape(port)
        is_idle = now.get("mmserve_num_requests_running", 0) == 0
        if is_idle and counters(now) == counters(last):
            return now
        last = now
    return last


def lm_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    def delta(name: str) -> float:
        return total(after, name) - total(before, name)

    def per_label(name: str, label: str) -> dict[str, float]:
        a, b = by_label(after, name, label), by_label(before, name, label)
        return {value: a[value] - b.get(value, 0) for value in sorted(a)}

    transfer = per_label("mmserve_embedding_transfer_bytes_total", "direction")
    return {
        "embedding_bytes_received": transfer.get("received", 0),
        "embedding_bytes_sent": transfer.get("sent", 0),
        "local_items_encoded": delta("mmserve_encoder_items_encoded_total"),
        "retries": delta("mmserve_remote_encoder_retries_total"),
        "fallbacks": delta("mmserve_remote_encoder_fallbacks_total"),
        "dropped_messages": delta("mmserve_remote_encoder_dropped_messages_total"),
        "remote_items": per_label("mmserve_remote_encoder_items_total", "encoder"),
        "remote_latency_s": per_label("mmserve_remote_encoder_latency_seconds_total", "encoder"),
    }


def encoder_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    names = {
        "items_received": "mmserve_encoder_items_received_total",
        "items_encoded": "mmserve_encoder_items_encoded_total",
        "forward_calls": "mmserve_encoder_forward_calls_total",
        "cache_hits": "mmserve_encoder_cache_hits_total",
        "received_bytes": "mmserve_encoder_received_bytes_total",
        "sent_bytes": "mmserve_encoder_sent_bytes_total",
    }
    return {key: total(after, n) - total(before, n) for key, n in names.items()}


def workload_config(
    settings: Settings, images_per_request: int, seed: int, num_prompts: int
) -> WorkloadConfig:
    return WorkloadConfig(
        num_prompts=num_prompts,
        seed=seed,
        image_sizes=settings.image_sizes,
        images_per_request=images_per_request,
        input_len=settings.input_len,
        output_len=settings.output_len,
    )


def bench_flags(cfg: WorkloadConfig) -> list[str]:
    """The `mmserve bench serve` flags of a WorkloadConfig: the bench rebuilds the same list."""
    sizes = ",".join(f"{w}x{h}" for w, h in cfg.image_sizes)
    return [
        "--num-prompts", str(cfg.num_prompts), "--seed", str(cfg.seed),
        "--image-sizes", sizes, "--images-per-request", str(cfg.images_per_request),
        "--input-len", str(cfg.input_len), "--output-len", str(cfg.output_len),
        "--image-format", cfg.image_format, "--ignore-eos", "--request-rate", "inf",
    ]  # fmt: skip


def count_images(cfg: WorkloadConfig, shape: disagg_report.ModelShape) -> dict[str, int]:
    """Images and image tokens of the workload the bench sends for `cfg`, from each picture's
    size (rebuilt with the bench's own generator, so exactly the requests it sends)."""
    num_images = num_tokens = 0
    for request in build_synthetic(cfg):
        for part in request.messages[-1]["content"]:
            if part["type"] != "image_url":
                continue
            data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
            with Image.open(io.BytesIO(data)) as image:
                num_tokens += shape.image_tokens(*image.size)
            num_images += 1
    return {"num_images": num_images, "num_image_tokens": num_tokens}


def run_bench(cfg: WorkloadConfig, port: int, max_concurrency: int, stem: Path) -> dict:
    cmd = [sys.executable, "-m", "mmserve", "bench", "serve", "--disable-tqdm"]
    cmd += ["--base-url", f"http://127.0.0.1:{port}", "--max-concurrency", str(max_concurrency)]
    cmd += [*bench_flags(cfg), "--result-json", f"{stem}.json"]
    with open(f"{stem}.bench.log", "w") as log_file:
        done = subprocess.run(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, timeout=BENCH_TIMEOUT_S
        )
    if done.returncode != 0:
        raise RuntimeError(
            f"mmserve bench serve failed (code {done.returncode}); end of {stem}.bench.log:\n"
            f"{log_tail(Path(f'{stem}.bench.log'))}"
        )
    result = json.loads(Path(f"{stem}.json").read_text())
    return {
        "request_throughput": result["request_throughput"],
        "output_throughput": result["output_throughput"],
        "ttft_p50_ms": result["ttft"]["p50_ms"],
        "ttft_p99_ms": result["ttft"]["p99_ms"],
        "e2el_p50_ms": result["e2el"]["p50_ms"],
        "completed": result["completed"],
        "num_requests": result["num_requests"],
    }


@contextlib.contextmanager
def deployment(
    settings: Settings, name: str, model: Path, ports: Ports, round_idx: int
) -> Iterator[tuple[int, list[int]]]:
    """Start A (one serve) or B (2 encode, then serve --encoder-urls); yield the LM port and
    the encoders' HTTP ports; stop them all afterwards."""
    common = ["--model", str(model), "--dtype", settings.dtype, "--host", "127.0.0.1"]
    mmserve = [sys.executable, "-m", "mmserve"]
    env = dict(os.environ)
    with contextlib.ExitStack() as stack:
        encoder_ports = []
        for i in range(NUM_ENCODERS if name == "B" else 0):
            port, zmq_port = ports.take(), ports.take()
            cmd = [*mmserve, "encode", *common, "--port", str(port), "--zmq-port", str(zmq_port)]
            log_path = settings.out_dir / f"r{round_idx}-B-encode{i}.log"
            timeout_s = settings.startup_timeout_s
            startup_s = stack.enter_context(
                running_server(f"encode{i}", cmd, env, port, log_path, timeout_s)
            )
            log.info("round %d B: encode%d healthy after %.1f s", round_idx, i, startup_s)
            encoder_ports.append(port)
        port = ports.take()
        cmd = [*mmserve, "serve", *common, "--port", str(port), *settings.serve_args]
        if encoder_ports:
            cmd += ["--encoder-urls", *(f"http://127.0.0.1:{p}" for p in encoder_ports)]
        log_path = settings.out_dir / f"r{round_idx}-{name}-serve.log"
        startup_s = stack.enter_context(
            running_server(f"serve {name}", cmd, env, port, log_path, settings.startup_timeout_s)
        )
        log.info("round %d %s: serve healthy after %.1f s", round_idx, name, startup_s)
        yield port, encoder_ports


def measure_round(
    settings: Settings, document: dict, name: str, model: Path, ports: Ports, round_idx: int
) -> None:
    shape = disagg_report.shape_of(document)
    with deployment(settings, name, model, ports, round_idx) as (port, encoder_ports):
        warmup_seed = 900_000 + 10 * round_idx + "AB".index(name)
        most_images = max(settings.images_per_request)
        warmup = workload_config(settings, most_images, warmup_seed, WARMUP_PROMPTS)
        warmup_stem = settings.out_dir / f"r{round_idx}-{name}-warmup"
        run_bench(warmup, port, settings.max_concurrency, warmup_stem)
        for w_idx, images_per_request in enumerate(settings.images_per_request):
            seed = 1000 * round_idx + w_idx
            cfg = workload_config(settings, images_per_request, seed, settings.num_prompts)
            stem = settings.out_dir / f"r{round_idx}-{name}-{images_per_request}img"
            before = [scrape(p) for p in (port, *encoder_ports)]
            bench = run_bench(cfg, port, settings.max_concurrency, stem)
            after = [scrape_settled(port), *(scrape_settled(p) for p in encoder_ports)]
            result = {
                "round": round_idx,
                "workload": document["workloads"][w_idx]["name"],
                "deployment": name,
                "seed": seed,
                "bench": bench,
                "images": count_images(cfg, shape),
                "lm": lm_delta(before[0], after[0]),
                "encoders": {
                    f"http://127.0.0.1:{p}": encoder_delta(b, a)
                    for p, b, a in zip(encoder_ports, before[1:], after[1:], strict=True)
                },
            }
            document["runs"].append(result)
            write_document(settings, document)
            log.info(
                "round %d %s %s: %.2f req/s, TTFT p50 %.0f ms, %d/%d completed",
                round_idx, name, result["workload"], bench["request_throughput"],
                bench["ttft_p50_ms"], bench["completed"], bench["num_requests"],
            )  # fmt: skip


def write_document(settings: Settings, document: dict) -> None:
    path = settings.out_dir / "disagg_compare.json"
    path.write_text(json.dumps(document, indent=2) + "\n")


def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def new_document(settings: Settings, model: Path) -> dict:
    config = json.loads((model / "config.json").read_text())
    shape = disagg_report.model_shape(model.name, config, settings.dtype)
    for width, height in settings.image_sizes:
        shape.image_tokens(width, height)  # refuses a size whose count would not be exact
    dirty = git("status", "--porcelain", "--", "src", "benchmarks")
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": (git("rev-parse", "--short", "HEAD") or "unknown")
        + (" (with uncommitted changes)" if dirty else ""),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} "
        "at the start",
        "checkpoint": f"{model} ({shape.dtype})",
        "command": shlex.join(["python", *sys.argv]),
        "model": shape._asdict(),
        "workloads": [
            {
                "name": f"{n} image{'s' if n > 1 else ''}/request",
                "images_per_request": n,
                "image_sizes": [list(s) for s in settings.image_sizes],
            }
            for n in settings.images_per_request
        ],  # fmt: skip
        "settings": {k: str(v) for k, v in vars(settings).items()},
        "runs": [],
    }


def run(settings: Settings) -> int:
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    model = ensure_model(settings)
    document = new_document(settings, model)
    ports = Ports(settings.base_port)
    try:
        for round_idx in range(1, settings.rounds + 1):
            for name in "AB" if round_idx % 2 else "BA":
                measure_round(settings, document, name, model, ports, round_idx)
    finally:  # a run cut short still reports what it measured
        document["host"] += f", {os.getloadavg()[0]:.2f} at the end"
        write_document(settings, document)
        if document["runs"]:
            print(disagg_report.markdown(document), flush=True)
        print(f"results: {settings.out_dir / 'disagg_compare.json'}", flush=True)
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flag = parser.add_argument
    flag("--report", type=Path, help="print the Markdown section of a saved JSON and exit")
    flag("--out-dir", type=Path, default=Path("/tmp/mmserve-disagg"))
    flag("--model", type=Path, help="a Qwen2-VL checkpoint (default: the tiny one, written)")
    flag("--rounds", type=int, default=2)
    flag("--num-prompts", type=int, default=32)
    flag("--max-concurrency", type=int, default=8)
    flag("--image-sizes", default="448x448,224x224", help="WIDTHxHEIGHT list, multiples of 28")
    flag("--images-per-request", default="1,2", help="one workload per value")
    flag("--input-len", type=int, default=32)
    flag("--output-len", type=int, default=16)
    flag("--dtype", default="bfloat16", help="of every server (encoders must match the LM)")
    flag("--base-port", type=int, default=18300)
    flag("--serve-args", default="", help="extra flags for both deployments' `mmserve serve`")
    flag("--startup-timeout-s", type=float, default=300)
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(
        out_dir=args.out_dir,
        model_dir=args.model,
        rounds=args.rounds,
        num_prompts=args.num_prompts,
        max_concurrency=args.max_concurrency,
        image_sizes=parse_image_sizes(args.image_sizes),
        images_per_request=tuple(int(n) for n in args.images_per_request.split(",")),
        input_len=args.input_len,
        output_len=args.output_len,
        dtype=args.dtype,
        base_port=args.base_port,
        serve_args=tuple(shlex.split(args.serve_args)),
        startup_timeout_s=args.startup_timeout_s,
    )


def exit_on_signal(signum: int, _frame) -> None:
    # SystemExit unwinds through running_server's `finally`, which stops the servers.
    log.error("%s: stopping", signal.Signals(signum).name)
    raise SystemExit(128 + signum)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, exit_on_signal)
    try:
        args = parse_args(sys.argv[1:])
        if args.report is not None:
            print(disagg_report.markdown(json.loads(args.report.read_text())), end="")
            return 0
        return run(settings_from(args))
    except (ValueError, RuntimeError, OSError, subprocess.SubprocessError) as e:
        log.error("%s", e)
        return 1
    except KeyboardInterrupt:
        log.error("interrupted; servers stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
