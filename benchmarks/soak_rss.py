"""Soak a real `mmserve serve` with new and repeated pictures and watch its resident memory.

Usage (bounded: stops at --num-requests or --duration-s, whichever comes first):

    PYTHONPATH=src .venv/bin/python benchmarks/soak_rss.py --clients 16 --duration-s 120 \
        --new-fraction 0.6 -- --mm-processor-cache-gb 0.05

Everything after `--` is passed to `mmserve serve` (the bundled toy model unless --model is
given there). The server listens on 127.0.0.1 only. Every --sample-s the script records the
server's VmRSS (from /proc/<pid>/status) and the summed VmRSS of its child processes (decode
workers), then prints the curve and the growth over the second half of the run: the goal is
that RSS levels off once the caches are full, so that growth is near zero.

A "new" picture is a random size (--min-side..--max-side) with random pixel content and, for
--exif-fraction of them, an EXIF block with a unique ImageUniqueID (EXIF rides in img.info);
a repeat resends one of the last 64 new pictures byte for byte.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

EXIF_IMAGE_UNIQUE_ID = 0xA420
EXIF_SUB_IFD = 0x8769
REPEAT_POOL = 64


@dataclass
class Tally:
    ok: int = 0
    failed: int = 0
    statuses: dict[int, int] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return 0


def child_pids(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def new_picture(rng: random.Random, args: argparse.Namespace) -> bytes:
    """A random-content JPEG (cheap to encode on a shared machine) of a random size."""
    width = rng.randint(args.min_side, args.max_side)
    height = rng.randint(args.min_side, args.max_side)
    # Low-resolution noise upscaled: compresses like a photo, unlike per-pixel noise.
    small = np.random.default_rng(rng.getrandbits(32)).integers(0, 256, (16, 16, 3), np.uint8)
    img = Image.fromarray(small).resize((width, height), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    if rng.random() < args.exif_fraction:
        exif = Image.Exif()
        exif.get_ifd(EXIF_SUB_IFD)[EXIF_IMAGE_UNIQUE_ID] = f"{rng.getrandbits(128):032x}"
        img.save(buf, format="JPEG", quality=85, exif=exif)
    else:
        img.save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def request_body(picture: bytes, model: str, max_tokens: int) -> dict:
    url = "data:image/jpeg;base64," + base64.b64encode(picture).decode()
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "what shape is this?"},
    ]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


async def client(
    idx: int,
    http: httpx.AsyncClient,
    args: argparse.Namespace,
    model: str,
    budget: list[int],
    deadline: float,
    pool: list[bytes],
    tally: Tally,
) -> None:
    rng = random.Random(args.seed * 1000 + idx)
    while budget[0] > 0 and time.monotonic() < deadline:
        budget[0] -= 1
        if not pool or rng.random() < args.new_fraction:
            picture = await asyncio.to_thread(new_picture, rng, args)
            pool.append(picture)
            del pool[:-REPEAT_POOL]
        else:
            picture = rng.choice(pool)
        try:
            resp = await http.post(
                "/v1/chat/completions", json=request_body(picture, model, args.max_tokens)
            )
            status = resp.status_code
        except httpx.HTTPError:
            status = 0
        tally.statuses[status] = tally.statuses.get(status, 0) + 1
        if status == 200:
            tally.ok += 1
        else:
            tally.failed += 1


async def sampler(
    pid: int, interval_s: float, stop: asyncio.Event, out: list[tuple[float, int, int]]
) -> None:
    start = time.monotonic()
    while not stop.is_set():
        workers = sum(vm_rss_bytes(c) for c in child_pids(pid))
        out.append((time.monotonic() - start, vm_rss_bytes(pid), workers))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


async def soak(args: argparse.Namespace, url: str, pid: int) -> tuple[list, Tally, float]:
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout_s) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        samples: list[tuple[float, int, int]] = []
        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler(pid, args.sample_s, stop, samples))
        tally, pool, budget = Tally(), [], [args.num_requests]
        start = time.monotonic()
        deadline = start + args.duration_s
        await asyncio.gather(
            *(
                client(i, http, args, model, budget, deadline, pool, tally)
                for i in range(args.clients)
            )
        )
        elapsed = time.monotonic() - start
        stop.set()
        await sampling
    return samples, tally, elapsed


def report(samples: list[tuple[float, int, int]], tally: Tally, elapsed: float) -> None:
    mib = 1 << 20
    print(f"{'t (s)':>7} {'server RSS MiB':>15} {'workers RSS MiB':>16}")
    step = max(1, len(samples) // 30)
    for t, rss, workers in samples[::step] + samples[-1:]:
        print(f"{t:7.1f} {rss / mib:15.1f} {workers / mib:16.1f}")
    half = samples[len(samples) // 2 :]
    quarter = max(1, len(half) // 4)
    head = statistics.median(s[1] for s in half[:quarter])
    tail = statistics.median(s[1] for s in half[-quarter:])
    ts = np.array([s[0] for s in half])
    rss = np.array([s[1] for s in half], dtype=np.float64)
    slope = np.polyfit(ts, rss, 1)[0] * 60 / mib if len(half) > 1 else 0.0
    print(
        f"requests: {tally.ok} ok, {tally.failed} failed {tally.statuses} in {elapsed:.1f} s "
        f"({(tally.ok + tally.failed) / elapsed:.1f} req/s)"
    )
    print(f"server RSS start {samples[0][1] / mib:.1f} MiB, end {samples[-1][1] / mib:.1f} MiB")
    print(
        f"second half: growth {(tail - head) / mib:+.1f} MiB (median of its last quarter minus "
        f"its first), fitted slope {slope:+.1f} MiB/min"
    )


def main() -> int:
    argv = sys.argv[1:]
    serve_extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=100_000)
    p.add_argument("--duration-s", type=float, default=120.0)
    p.add_argument("--new-fraction", type=float, default=0.6)
    p.add_argument("--exif-fraction", type=float, default=0.5)
    p.add_argument("--min-side", type=int, default=64)
    p.add_argument("--max-side", type=int, default=1536)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--sample-s", type=float, default=1.0)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default="soak_rss_server.log", help="where the server's output goes")
    args = p.parse_args(own)
    if not 0 <= args.new_fraction <= 1 or args.clients < 1 or args.duration_s > 3600:
        p.error("--new-fraction in [0, 1], --clients >= 1, --duration-s at most 3600")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mmserve", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with Path(args.log).open("w") as log:
        server = subprocess.Popen([*cmd, *serve_extra], stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 180
            while True:
                if server.poll() is not None:
                    print(f"server exited early; see {args.log}", file=sys.stderr)
                    return 1
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    print("server did not start within 180 s", file=sys.stderr)
                    return 1
                time.sleep(0.5)
            samples, tally, elapsed = asyncio.run(soak(args, url, server.pid))
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    report(samples, tally, elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
