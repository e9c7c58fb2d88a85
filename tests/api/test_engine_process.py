"""The server's engine core in its own process: it dies loudly, never silently or by hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.factory import png_bytes
from tests.support.harness import Server, data_url, image_part, user

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")


def engine_core_pid(server_pid: int) -> int:
    """The pid of the server's engine-core child process (found through /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
        except OSError:
            continue
        ppid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid"))
        if ppid == server_pid and b"mmserve.engine.core.process" in cmdline:
            return int(entry.name)
    raise AssertionError(f"server {server_pid} has no engine-core child")


def pid_alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


def test_killing_the_engine_fails_requests_fast_and_the_server_exits_non_zero(
    qwen2_vl_dir: Path, tmp_path: Path
) -> None:
    srv = Server(qwen2_vl_dir, tmp_path / "kill.log")
    name = srv.client.models.list().data[0].id
    core_pid = engine_core_pid(srv.proc.pid)
    results: list[tuple[str, object]] = []

    def stream_one(seed: int) -> None:
        body = {
            "model": name,
            "messages": user(image_part(data_url(png_bytes(56, 56, seed=seed))), "Go on."),
            "ignore_eos": True,
            "stream": True,
        }
        start = time.monotonic()
        try:
            with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=60) as r:
                text = "".join(r.iter_text())
            results.append(("done", (r.status_code, text, time.monotonic() - start)))
        except httpx.HTTPError as exc:
            results.append(("transport", (exc, time.monotonic() - start)))

    threads = [threading.Thread(target=stream_one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # every request is decoding now
    killed_at = time.monotonic()
    os.kill(core_pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a client hangs after the engine died"
    # Each stream ends with the error in-band (its 200 was sent long ago), within seconds.
    assert len(results) == 3
    for kind, detail in results:
        assert kind == "done", detail
        status, text, _ = detail  # type: ignore[misc]
        assert status == 200
        assert "engine_dead" in text, text[-500:]
        assert text.rstrip().endswith("data: [DONE]")
    # The server does not linger as a zombie front end: it exits non-zero, soon.
    returncode = srv.proc.wait(timeout=30)
    assert time.monotonic() - killed_at < 30
    srv.log.close()
    assert returncode != 0
    log = srv.log_path.read_text()
    assert "killed by signal 9" in log


def test_health_turns_503_and_the_server_exits_once_the_engine_is_gone(
    qwen2_vl_dir: Path, tmp_path: Path
) -> None:
    srv = Server(qwen2_vl_dir, tmp_path / "health.log")
    os.kill(engine_core_pid(srv.proc.pid), signal.SIGKILL)
    killed_at = time.monotonic()
    last_ok = killed_at
    while time.monotonic() < killed_at + 20:
        try:
            r = httpx.get(f"{srv.url}/health", timeout=2)
        except httpx.TransportError:
            break  # the server has stopped listening: it is on its way out
        if r.status_code == 200:
            last_ok = time.monotonic()
        else:
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "engine_dead"
        time.sleep(0.02)
    # the idle engine loop looks at the process every 50 ms: healthy no longer than that
    assert last_ok - killed_at < 1.0
    assert srv.proc.wait(timeout=30) != 0
    srv.log.close()


def test_the_engine_process_does_not_outlive_a_killed_server(
    qwen2_vl_dir: Path, tmp_path: Path
) -> None:
    srv = Server(qwen2_vl_dir, tmp_path / "orphan.log")
    core_pid = engine_core_pid(srv.proc.pid)
    name = srv.client.models.list().data[0].id
    body = {"model": name, "messages": user("Go on."), "ignore_eos": True, "stream": True}

    def forever() -> None:  # keeps the engine busy (up to the model length) until the kill
        try:
            with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=30) as r:
                for _ in r.iter_text():
                    pass
        except httpx.HTTPError:
            pass

    client = threading.Thread(target=forever)
    client.start()
    time.sleep(1.0)
    srv.proc.kill()  # no chance to shut anything down, while a request runs
    srv.proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while pid_alive(core_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    srv.log.close()
    client.join(timeout=30)
    assert not pid_alive(core_pid), "the engine process was left behind"


def test_sigterm_stops_the_engine_process_too(qwen2_vl_dir: Path, tmp_path: Path) -> None:
    srv = Server(qwen2_vl_dir, tmp_path / "term.log")
    core_pid = engine_core_pid(srv.proc.pid)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=30) == 0
    srv.log.close()
    assert not pid_alive(core_pid)


def test_no_multiprocess_serves_from_one_process(qwen2_vl_dir: Path, tmp_path: Path) -> None:
    srv = Server(qwen2_vl_dir, tmp_path / "single.log", "--no-multiprocess")
    try:
        with pytest.raises(AssertionError, match="no engine-core child"):
            engine_core_pid(srv.proc.pid)
        name = srv.client.models.list().data[0].id
        out = srv.client.chat.completions.create(model=name, messages=user("Hi"), max_tokens=3)
        assert out.choices[0].finish_reason in ("stop", "length")
    finally:
        srv.stop()


def test_a_broken_checkpoint_fails_start_up_with_the_engine_error(
    qwen2_vl_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in qwen2_vl_dir.iterdir():
        if not f.name.endswith(".safetensors") and f.is_file():
            (broken / f.name).write_bytes(f.read_bytes())
    proc = subprocess.run(
        [sys.executable, "-m", "mmserve", "serve", "--model", str(broken), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "the engine process failed to start" in proc.stderr
