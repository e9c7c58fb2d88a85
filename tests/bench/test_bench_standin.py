"""`python -m mmserve.bench serve` end to end against a stand-in OpenAI server on 127.0.0.1."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from tests.bench.standin_server import StandInOptions, free_port, serve_standin

LATENCY_KEYS = ("ttft", "tpot", "itl", "e2el")


def run_bench(base_url: str, tmp_path: Path, *extra: str) -> tuple[dict, str]:
    result_json = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "mmserve.bench", "serve", "--base-url", base_url,
           "--result-json", str(result_json), "--disable-tqdm", *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(result_json.read_text(), parse_constant=_reject_non_json), proc.stdout


def _reject_non_json(name: str) -> None:
    raise AssertionError(f"result JSON holds {name}, which strict JSON readers refuse")


def assert_percentiles_ordered(result: dict) -> None:
    for key in LATENCY_KEYS:
        s = result[key]
        assert 0 < s["p50_ms"] <= s["p90_ms"] <= s["p99_ms"], (key, s)


def test_reports_latency_throughput_and_plot_without_metrics(tmp_path: Path) -> None:
    opts = StandInOptions(token_delay_s=0.01)
    plot = tmp_path / "bench.png"
    with serve_standin(opts) as url:
        result, stdout = run_bench(
            url, tmp_path, "--num-prompts", "12", "--image-sizes", "64x64,96x80",
            "--images-per-request", "2", "--repeat-ratio", "0.5", "--output-len", "5",
            "--shared-prefix-tokens", "8", "--max-concurrency", "4", "--plot", str(plot),
        )  # fmt: skip

    assert result["model"] == "standin-model"  # discovered from GET /v1/models
    assert (result["completed"], result["failed"], result["errors_by_kind"]) == (12, 0, {})
    assert [r["idx"] for r in result["requests"]] == list(range(12))
    assert all(r["success"] and r["output_tokens"] == 5 for r in result["requests"])
    assert result["total_output_tokens"] == 60 and result["num_with_usage"] == 12
    assert result["total_input_tokens"] == sum(r["prompt_tokens"] for r in result["requests"])
    assert_percentiles_ordered(result)
    # The stand-in sleeps 10 ms before each token (bounds loose: client-side jitter).
    assert result["itl"]["p50_ms"] >= 5 and result["tpot"]["mean_ms"] >= 7
    assert result["ttft"]["mean_ms"] >= 9
    expected_tput = result["total_output_tokens"] / result["duration_s"]
    assert np.isclose(result["output_throughput"], expected_tput)
    assert np.isclose(result["request_throughput"], 12 / result["duration_s"])
    assert result["server_metrics"]["available"] is False
    assert "404" in result["server_metrics"]["reason"]
    assert "Serving Benchmark Result" in stdout and "unavailable" in stdout

    # Repeats resend an earlier request's exact bytes: 6 of 12 requests, 2 images each.
    assert result["workload"]["num_requests_with_repeats"] == 6
    urls = [p["image_url"]["url"] for b in opts.received for p in b["messages"][-1]["content"]
            if p["type"] == "image_url"]  # fmt: skip
    assert len(urls) == 24 and len(set(urls)) == 12 == result["workload"]["num_unique_images"]
    systems = {b["messages"][0]["content"] for b in opts.received}
    assert len(systems) == 1  # the shared prefix is the same system prompt everywhere
    jpeg = base64.b64decode(urls[0].split(",", 1)[1])
    assert Image.open(io.BytesIO(jpeg)).size in {(64, 64), (96, 80)}
    assert all(b["ignore_eos"] and b["max_tokens"] == 5 for b in opts.received)

    png = Image.open(plot)
    assert png.format == "PNG" and png.size == (1500, 450)
    pixels = np.asarray(png.convert("RGB")).reshape(-1, 3)
    assert len(np.unique(pixels, axis=0)) > 20  # lines, text and axes, not a blank canvas


def test_counts_chunks_without_usage_and_sorts_errors_by_kind(tmp_path: Path) -> None:
    opts = StandInOptions(token_delay_s=0.002, send_usage=False, fail_every=4, truncate_request=5)
    with serve_standin(opts) as url:
        result, stdout = run_bench(
            url, tmp_path, "--num-prompts", "10", "--images-per-request", "0",
            "--output-len", "4", "--max-concurrency", "1",
        )  # fmt: skip
    # Requests 4 and 8 get HTTP 503; request 5's stream stops after two tokens without [DONE].
    assert result["errors_by_kind"] == {"http_503": 2, "incomplete_stream": 1}
    assert result["completed"] + result["failed"] == 10 and result["failed"] == 3
    ok = [r for r in result["requests"] if r["success"]]
    assert len(ok) == 7 and all(r["output_tokens"] == 4 for r in ok)  # one chunk per token
    assert result["num_with_usage"] == 0 and result["total_input_tokens"] is None
    assert "http_503" in stdout
    assert_percentiles_ordered(result)


def test_cache_hit_rates_follow_repeat_ratio_when_metrics_exist(tmp_path: Path) -> None:
    opts = StandInOptions(token_delay_s=0.001, with_metrics=True)
    with serve_standin(opts) as url:
        result, stdout = run_bench(
            url, tmp_path, "--num-prompts", "8", "--image-sizes", "56x56",
            "--repeat-ratio", "0.75", "--output-len", "3", "--max-concurrency", "2",
        )  # fmt: skip
    server = result["server_metrics"]
    assert server["available"] is True
    enc = server["cache_tiers"]["encoder_cache"]
    assert (enc["queries"], enc["hits"], enc["hit_rate"]) == (8, 6, 0.75)
    assert server["encoder_items_encoded"] == 2 == result["workload"]["num_unique_images"]
    assert server["cache_tiers"]["prefix_cache"]["hit_rate"] is None  # not exposed here
    assert "encoder hit rate" in stdout and "75.0%" in stdout


def test_unreachable_server_is_reported_as_connect_errors(tmp_path: Path) -> None:
    result_json = tmp_path / "down.json"
    cmd = [sys.executable, "-m", "mmserve.bench", "serve", "--disable-tqdm",
           "--base-url", f"http://127.0.0.1:{free_port()}/v1", "--model", "m",
           "--num-prompts", "3", "--images-per-request", "0",
           "--result-json", str(result_json)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1  # nothing completed
    result = json.loads(result_json.read_text())
    assert result["errors_by_kind"] == {"connect_error": 3} and result["ttft"] is None
    assert result["server_metrics"]["available"] is False
