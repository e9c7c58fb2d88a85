"""`mmserve serve` as a real process (CLI, uvicorn, middleware) over the echo engine.

The CLI is handed the echo engine in place of its engine factory, so HTTP-level behaviour (timeouts,
auth before the body, raw-socket cases) is tested without torch or a checkpoint.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.harness import free_port

_LAUNCHER = """
import sys
sys.path.insert(0, {root!r})
from tests.support.echo_engine import EchoEngine
from mmserve.cli import main

def build_engine(args):
    return EchoEngine(max_model_len=4096, token_delay_s=0.05)

sys.exit(main(sys.argv[1:], build_engine=build_engine))
"""


class EchoServer:
    """Start with `with EchoServer(tmp_path, "--api-key", "k") as server: ...`."""

    def __init__(self, tmp_path: Path, *extra: str) -> None:
        root = str(Path(__file__).resolve().parents[2])
        model_dir = tmp_path / "echo-ckpt"
        model_dir.mkdir(exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"server-{self.port}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        argv = ["serve", "--model", str(model_dir), "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER.format(root=root), *argv],
            stdout=self._log,
            stderr=self._log,
        )

    def __enter__(self) -> EchoServer:
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start:\n" + self.log()
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text()

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed."""
    start = time.monotonic()
    chunks = []
    while True:
        remaining = timeout_s - (time.monotonic() - start)
        assert remaining > 0, f"the server kept the connection open for {timeout_s} s"
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        except TimeoutError:
            raise AssertionError(f"the server kept the connection open for {timeout_s} s") from None
        if not chunk:
            return b"".join(chunks), time.monotonic() - start
        chunks.append(chunk)
