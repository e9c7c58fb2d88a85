"""A real `python -m mmserve serve` subprocess on 127.0.0.1, and small helpers to drive it."""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A free port: any the OS gives, or on a machine where tests must keep to a range, a free
    one of `MMSERVE_TEST_PORTS` ("9100-9119") not given before in this process (callers often
    take two before binding either)."""
    first, _, last = os.environ.get("MMSERVE_TEST_PORTS", "0-0").partition("-")
    for port in range(int(first), int(last or first) + 1):
        if port and port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            given = s.getsockname()[1]
        if port:
            _PORTS_GIVEN.add(given)
        return given
    if _PORTS_GIVEN:  # every one given once: servers of earlier tests have stopped by now
        _PORTS_GIVEN.clear()
        return free_port()
    raise OSError(f"no free port in MMSERVE_TEST_PORTS={first}-{last}")


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict | str) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "user", "content": content}]


def parse_samples(text: str, model_name: str | None = None) -> dict[str, float]:
    """Every sample of a /metrics text by name and labels, `model_name` left out of the key
    (`mmserve_kv_blocks_free`, `mmserve_ttft_bucket{le="+Inf"}`). Each sample must carry a
    model_name, and the one given if one is."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            served = labels.pop("model_name", None)
            assert served is not None, f"{sample.name} has no model_name label"
            assert model_name is None or served == model_name, (sample.name, served)
            rest = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            samples[sample.name + (f"{{{rest}}}" if rest else "")] = float(sample.value)
    return samples


def read_metrics(url: str) -> dict[str, float]:
    return parse_samples(httpx.get(f"{url}/metrics", timeout=10).text)


def wait_until_idle(url: str, timeout_s: float = 20.0) -> dict[str, float]:
    """Poll /metrics until no request runs and every KV block and encoder slot is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = read_metrics(url)
        idle = (
            m["mmserve_num_requests_running"] == 0
            and m["mmserve_num_requests_waiting"] == 0
            and m["mmserve_kv_blocks_free"] == m["mmserve_kv_blocks_total"]
            and m["mmserve_encoder_cache_used_slots"] == 0
        )
        if idle:
            return m
        assert time.monotonic() < deadline, f"server did not become idle: {m}"
        time.sleep(0.2)


def wait_until_healthy(
    proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float = 180
) -> None:
    """Until `url`/health answers 200; fails with the log if the process exits or time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log_path.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} did not start:\n" + log_path.read_text()
        time.sleep(0.2)


class Server:
    def __init__(
        self,
        model_dir: Path | str,
        log_path: Path,
        *extra: str,
        positional: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        """`positional`: the model as vLLM's first argument instead of --model; `env`: the
        server's whole environment (default: this process's)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        model = [str(model_dir)] if positional else ["--model", str(model_dir)]
        argv = ["serve", *model, "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mmserve", *argv], stdout=self.log, stderr=self.log, env=env
        )
        self.log_path = log_path
        wait_until_healthy(self.proc, self.url, log_path)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
