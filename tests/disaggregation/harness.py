"""Real `mmserve encode` subprocesses on 127.0.0.1 for the pool's end-to-end tests."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.harness import free_port, parse_samples, wait_until_healthy


class Encoder:
    """`python -m mmserve encode` on a free port pair; `start()` then `wait_ready()`, so that
    several start in parallel."""

    def __init__(self, model_dir: Path | str, log_path: Path, *extra: str) -> None:
        self.port = free_port()
        with socket.socket() as held:  # a range-bound free_port would give the same one again
            held.bind(("127.0.0.1", self.port))
            self.zmq_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        argv = ["encode", "--model", str(model_dir), "--port", str(self.port)]
        argv += ["--zmq-port", str(self.zmq_port), *extra]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mmserve", *argv], stdout=self.log, stderr=self.log
        )

    def wait_ready(self, timeout_s: float = 180) -> Encoder:
        self.log.flush()
        wait_until_healthy(self.proc, self.url, self.log_path, timeout_s)
        return self

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def metrics(self) -> dict[str, float]:
        return parse_samples_any(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def pause(self) -> None:
        """Stop answering without closing a socket: a hung encoder."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def parse_samples_any(text: str) -> dict[str, float]:
    """Every sample by name and labels (an encoder's series carry no model_name)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            rest = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            samples[sample.name + (f"{{{rest}}}" if rest else "")] = float(sample.value)
    return samples


def metric_sum(samples: dict[str, float], name: str) -> float:
    """A series summed over its labels."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


__all__ = ["Encoder", "free_port", "metric_sum", "parse_samples", "parse_samples_any"]
