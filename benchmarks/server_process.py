"""Run one benchmark server as a child process: start it, wait until healthy, always stop it."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("server_process")

SERVER_STOP_S = 30
LOG_TAIL_LINES = 40


class ServerError(RuntimeError):
    """The server did not come up; the message carries the end of its log."""


def is_port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def is_healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:  # refused while starting, or an HTTP error status
        return False


def log_tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(lines[-LOG_TAIL_LINES:])


@contextlib.contextmanager
def running_server(
    name: str, cmd: list[str], env: dict[str, str], port: int, log_path: Path, timeout_s: float
) -> Iterator[float]:
    """Start a server, wait for GET /health, yield its start-up seconds; always stop it."""
    if is_port_open(port):
        raise ServerError(f"port {port} is already in use; stop what listens there or change it")
    log.info("starting %s: %s", name, shlex.join(cmd))
    with log_path.open("w") as log_file:
        # A session of its own, so that stopping it also stops its engine processes.
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    is_up = False
    try:
        startup_s = wait_until_healthy(name, proc, port, log_path, timeout_s)
        is_up = True
        yield startup_s
    finally:
        # A server still starting has nothing to wind down (and vLLM defers SIGTERM then).
        stop_server(proc, grace_s=SERVER_STOP_S if is_up else 0)


def wait_until_healthy(
    name: str, proc: subprocess.Popen, port: int, log_path: Path, timeout_s: float
) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise ServerError(
                f"{name} exited with code {proc.returncode} before it was healthy; "
                f"end of {log_path}:\n{log_tail(log_path)}"
            )
        if is_healthy(port):
            return time.monotonic() - started
        time.sleep(0.5)
    raise ServerError(
        f"{name} was not healthy after {timeout_s:.0f} s; end of {log_path}:\n{log_tail(log_path)}"
    )


def stop_server(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the server alone, so that it shuts its own engine processes down in order, then
    after at most grace_s SIGKILL to whatever is left of its session (stragglers, or a server
    that ignored SIGTERM), and wait until those are gone too, so that the port and the memory
    are free for the next run."""
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + SERVER_STOP_S
    while live_group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)


def live_group_members(pgid: int) -> list[int]:
    """Processes of process group `pgid` that are not yet zombies (Linux /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # pid (comm) state ppid pgrp ...; comm may hold spaces, so split after its ")"
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(pgrp) == pgid and state != "Z":
                members.append(int(stat.parent.name))
    return members
