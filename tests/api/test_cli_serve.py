"""`mmserve serve` as a process over the echo engine: startup log, requests, SIGTERM → exit 0.

The CLI is handed a builder of the echo engine in place of its engine factory, so this runs
without torch or a checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

LAUNCHER = """
import sys
sys.path.insert(0, {root!r})
from tests.support.echo_engine import EchoEngine
from mmserve.cli import main

class DescribedEchoEngine(EchoEngine):
    def describe(self):
        return {{"kv_blocks": 16, "encoder_cache_slots": 4096}}

def build_engine(args):
    return DescribedEchoEngine(max_model_len=4096, token_delay_s=0.05)

sys.exit(main(sys.argv[1:], build_engine=build_engine))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("server did not become healthy")


def test_sigterm_lets_in_flight_requests_finish_and_exits_zero(tmp_path: Path) -> None:
    root = str(Path(__file__).resolve().parents[2])
    model_dir = tmp_path / "echo-ckpt"
    model_dir.mkdir()
    port = _free_port()
    env = {**os.environ, "MMSERVE_API_KEY": "from-env"}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER.format(root=root), "serve", "--model", str(model_dir)]
        + ["--port", str(port), "--log-level", "info"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        headers = {"Authorization": "Bearer from-env"}
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=5).json()
        assert models["data"][0]["id"] == str(model_dir)  # the --model string, as vLLM names it

        result: dict[str, object] = {}

        def in_flight() -> None:
            body = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 20}
            r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30)
            result["status"], result["body"] = r.status_code, r.json()

        thread = threading.Thread(target=in_flight)
        thread.start()
        time.sleep(0.3)  # the request is now generating (20 tokens × 50 ms)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        returncode = proc.wait(timeout=30)
        thread.join(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read() if proc.stderr else ""
    assert returncode == 0, stderr
    assert time.monotonic() - start < 30
    assert result["status"] == 200, result
    assert result["body"]["usage"]["completion_tokens"] == 20  # type: ignore[index]
    # One configuration block with the engine's resolved values, and no secret in it.
    assert "configuration:" in stderr
    assert "kv_blocks: 16" in stderr and "encoder_cache_slots: 4096" in stderr
    assert "from-env" not in stderr
    assert json.dumps("echo-ckpt")[1:-1] in stderr


@pytest.mark.parametrize("argv", [["serve", "--model", "/nonexistent/dir"], ["serve", "--seed"]])
def test_bad_command_lines_exit_2_with_a_message(argv: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mmserve", *argv], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "usage: mmserve serve" in proc.stderr
