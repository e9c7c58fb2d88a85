"""A server with two replicas: one killed mid-run costs at most its own requests, /health says
"degraded", and the replica restarts and serves again."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.factory import png_bytes
from tests.support.harness import Server, data_url, image_part, read_metrics, user

NUM_CLIENTS = 8
NUM_REQUESTS = 40
KILL_AFTER = 8  # answered requests before one replica is killed
HEALTH_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def dp_server(qwen2_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("dp_server") / "server.log"
    server = Server(qwen2_vl_dir, log, "-dp", "2", "--max-num-batched-tokens", "256")
    try:
        yield server
    finally:
        server.stop()


def _engine_pids(server_pid: int) -> list[int]:
    """The server's engine processes (its replicas), by their command line."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server_pid and b"mmserve.engine.core.process" in cmdline:
            pids.append(int(entry))
    return sorted(pids)


def _health(server: Server) -> dict:
    response = httpx.get(f"{server.url}/health", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def _wait_health(server: Server, condition, what: str) -> dict:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while True:
        body = _health(server)
        if condition(body):
            return body
        assert time.monotonic() < deadline, f"/health never showed {what}: {body}"
        time.sleep(0.1)


def _chat(server: Server, content: list[dict], max_tokens: int = 16) -> int:
    body = {
        "model": server.client.models.list().data[0].id,
        "messages": content,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=180)
    return response.status_code


def test_a_killed_replica_costs_only_its_requests_then_restarts_and_serves(
    dp_server: Server,
) -> None:
    body = _health(dp_server)
    assert body["status"] == "ok" and body["replicas_live"] == 2, body
    pids = _engine_pids(dp_server.proc.pid)
    assert len(pids) == 2, pids
    answered = threading.Semaphore(0)
    killed_at: list[float] = []
    results: list[tuple[float, int]] = []  # (when sent, status)

    def one(n: int) -> None:
        sent = time.monotonic()
        picture = image_part(data_url(png_bytes(56, 56, seed=1000 + n)))
        status = _chat(dp_server, user(picture, f"Request {n}?"))
        results.append((sent, status))
        answered.release()

    def killer() -> None:
        for _ in range(KILL_AFTER):
            answered.acquire()
        os.kill(pids[0], signal.SIGKILL)
        killed_at.append(time.monotonic())

    kill_thread = threading.Thread(target=killer)
    kill_thread.start()
    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        list(pool.map(one, range(NUM_REQUESTS)))
    kill_thread.join()
    assert killed_at, "the replica was never killed"
    after = [status for sent, status in results if sent > killed_at[0]]
    failed = [status for _, status in results if status != 200]
    assert after and all(status == 200 for status in after), results
    # only requests that were running on the killed replica may fail, and only with a 503
    assert len(failed) <= NUM_CLIENTS and set(failed) <= {503}, results

    body = _wait_health(
        dp_server, lambda b: b["status"] == "ok" and b["replicas_live"] == 2, "a rejoin"
    )
    assert len(_engine_pids(dp_server.proc.pid)) == 2
    before = {r["replica"]: r["requests"] for r in body["replicas"]}
    # distinct pictures: their identities spread over both replicas (all 16 on one: 2**-15)
    for n in range(16):
        picture = image_part(data_url(png_bytes(56, 56, seed=2000 + n)))
        assert _chat(dp_server, user(picture, "After the restart?"), max_tokens=2) == 200
    after_rejoin = {r["replica"]: r["requests"] for r in _health(dp_server)["replicas"]}
    assert all(after_rejoin[i] > before[i] for i in before), (before, after_rejoin)


def test_health_says_degraded_while_a_replica_restarts(dp_server: Server) -> None:
    _wait_health(dp_server, lambda b: b["status"] == "ok", "both replicas live")
    pids = _engine_pids(dp_server.proc.pid)
    os.kill(pids[-1], signal.SIGKILL)
    # the restart waits a second before it starts a process that must load the model
    body = _wait_health(dp_server, lambda b: b["status"] != "ok", "the loss")
    assert body["status"] == "degraded" and body["replicas_live"] == 1, body
    down = [r for r in body["replicas"] if r["state"] == "restarting"]
    assert len(down) == 1 and "killed by signal 9" in down[0]["reason"], body
    assert _chat(dp_server, user("Still answering?"), max_tokens=2) == 200
    _wait_health(dp_server, lambda b: b["status"] == "ok", "the rejoin")


def test_metrics_show_each_replicas_encodes_their_total_and_the_routing(dp_server: Server) -> None:
    _wait_health(dp_server, lambda b: b["status"] == "ok", "both replicas live")
    for n in range(4):
        picture = image_part(data_url(png_bytes(56, 56, seed=3000 + n)))
        assert _chat(dp_server, user(picture, "Metrics?"), max_tokens=2) == 200
    samples = read_metrics(dp_server.url)
    name = "mmserve_encoder_items_encoded_total"
    per_replica = [samples[f'{name}{{modality="image",replica="{i}"}}'] for i in range(2)]
    assert sum(per_replica) == samples[f'{name}{{modality="image"}}'] >= 4, samples
    routed = sum(
        samples[f'mmserve_dp_routed_requests_total{{reason="{r}"}}'] for r in ("affinity", "load")
    )
    requests = sum(r["requests"] for r in _health(dp_server)["replicas"])
    assert routed == requests, (routed, requests)
