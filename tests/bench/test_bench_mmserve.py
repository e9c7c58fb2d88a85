"""Acceptance: `python -m mmserve.bench serve` against a real `mmserve serve` on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.bench.standin_server import free_port


@pytest.fixture(scope="module")
def mmserve_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("mmserve") / "server.log"
    cmd = [sys.executable, "-m", "mmserve", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"mmserve serve exited:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no /health:\n{log_path.read_text()[-3000:]}"
            try:
                if httpx.get(url + "/health", timeout=1.0, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_bench_against_mmserve_accounts_for_every_request(mmserve_url: str, tmp_path: Path) -> None:
    result_json = tmp_path / "result.json"
    # 8 requests, 2 unique 112x112 images, 6 exact repeats; one at a time, so every repeat
    # finds its image already encoded and still resident in the encoder cache.
    cmd = [sys.executable, "-m", "mmserve.bench", "serve", "--base-url", mmserve_url,
           "--num-prompts", "8", "--image-sizes", "112x112", "--repeat-ratio", "0.75",
           "--output-len", "4", "--input-len", "8", "--request-rate", "inf",
           "--max-concurrency", "1", "--seed", "0", "--disable-tqdm",
           "--result-json", str(result_json)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(result_json.read_text())

    assert (result["completed"], result["failed"]) == (8, 0), result["errors_by_kind"]
    assert len(result["requests"]) == 8 and all(r["success"] for r in result["requests"])
    assert result["total_output_tokens"] == 32  # ignore_eos: exactly max_tokens each
    # Inter-token gaps exist only between non-empty text chunks: a toy answer like "red"
    # followed by special tokens (ignore_eos) streams one chunk and has no ITL sample.
    has_gaps = any(r["content_chunks"] >= 2 for r in result["requests"])
    for key in ("ttft", "tpot", "itl", "e2el"):
        s = result[key]
        if key == "itl" and not has_gaps:
            assert s is None, s
            continue
        assert s is not None and 0 < s["p50_ms"] <= s["p90_ms"] <= s["p99_ms"], (key, result)
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0

    server = result["server_metrics"]
    assert server["available"] is True, server
    tiers = server["cache_tiers"]
    for tier in ("processor_cache", "encoder_cache", "prefix_cache"):
        t = tiers[tier]
        assert t["queries"] is not None and t["hits"] is not None, (tier, t)
        assert 0 <= t["hits"] <= t["queries"], (tier, t)
    workload = result["workload"]
    assert (workload["num_images"], workload["num_repeated_images"]) == (8, 6)
    enc = tiers["encoder_cache"]
    assert (enc["queries"], enc["hits"]) == (8, 6), enc
    assert enc["hit_rate"] == pytest.approx(0.75)  # == --repeat-ratio
    assert server["encoder_items_encoded"] == 2 == workload["num_unique_images"]
    assert 1 <= server["encoder_forward_calls"] <= 2
    assert tiers["prefix_cache"]["queries"] > 0  # tokens looked up
