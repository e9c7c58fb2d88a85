"""A benchmark server that fails says why; one that starts is always stopped afterwards."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
from benchmarks.server_process import ServerError, is_port_open, running_server

# A stand-in server: answers GET /health with 200 on the port given as its first argument.
HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
print("listening", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan may wait a while for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_healthy_server_is_stopped_on_leaving(tmp_path: Path) -> None:
    port, log_path = free_port(), tmp_path / "server.log"
    cmd = [sys.executable, "-c", HEALTH_SERVER, str(port)]
    with running_server("standin", cmd, dict(os.environ), port, log_path, 30) as startup_s:
        assert 0 <= startup_s < 30
        assert is_port_open(port)
    assert not is_port_open(port)
    assert "listening" in log_path.read_text()


def test_stopping_a_server_also_stops_what_it_started(tmp_path: Path) -> None:
    # The stand-in leaves a child behind that ignores SIGTERM, as an engine process might.
    orphan = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
    script = (
        f"import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', {orphan!r}]).pid)"
    )
    port, log_path = free_port(), tmp_path / "server.log"
    cmd = [sys.executable, "-c", script + "\n" + HEALTH_SERVER, str(port)]
    with running_server("standin", cmd, dict(os.environ), port, log_path, 30):
        child_pid = int(log_path.read_text().split()[0])
        assert is_running(child_pid)
    assert not is_running(child_pid)


def test_a_server_is_stopped_when_the_body_raises(tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-c", HEALTH_SERVER, str(port)]
    with (
        pytest.raises(KeyboardInterrupt),
        running_server("standin", cmd, dict(os.environ), port, tmp_path / "s.log", 30),
    ):
        raise KeyboardInterrupt
    assert not is_port_open(port)


def test_a_server_that_exits_raises_with_the_end_of_its_log(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "print('model not found: /nowhere'); raise SystemExit(3)"]
    with (
        pytest.raises(ServerError, match=r"exited with code 3(.|\n)*model not found: /nowhere"),
        running_server("broken", cmd, dict(os.environ), free_port(), tmp_path / "s.log", 30),
    ):
        pytest.fail("the body must not run for a server that never became healthy")


def test_a_server_that_never_gets_healthy_times_out(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "import time; print('compiling', flush=True); time.sleep(60)"]
    with (
        pytest.raises(ServerError, match=r"not healthy after 1 s(.|\n)*compiling"),
        running_server("slow", cmd, dict(os.environ), free_port(), tmp_path / "s.log", 1),
    ):
        pytest.fail("the body must not run for a server that never became healthy")


def test_a_busy_port_is_refused_before_starting(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with (
            pytest.raises(ServerError, match="already in use"),
            running_server("late", ["false"], dict(os.environ), port, tmp_path / "s.log", 30),
        ):
            pytest.fail("must not start a second server on a busy port")
