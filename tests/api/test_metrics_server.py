"""/metrics of a real server after real requests, engine core in its own process and not.

What a Grafana user reads off it must add up: one histogram observation per finished request,
token counters equal to the usage the clients were told, and phases that fit inside the
end-to-end latency.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmserve.metrics import HISTOGRAM_NAMES, PHASE_HISTOGRAMS, TOKEN_HISTOGRAMS
from tests.support.factory import png_bytes
from tests.support.harness import Server, data_url, image_part, user, wait_until_idle

SERVED = "tiny-qwen2-vl"


@pytest.fixture(scope="module", params=["--multiprocess", "--no-multiprocess"])
def server(request, qwen2_vl_dir: Path, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("metrics") / "server.log"
    srv = Server(qwen2_vl_dir, log, request.param, "--served-model-name", SERVED)
    yield srv
    srv.stop()


def _ask(server: Server, job: tuple[list[dict], int]):
    messages, max_tokens = job
    return server.client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=max_tokens, temperature=0
    ).usage


def _scrape(server: Server) -> dict[str, float]:
    """Sample name (+ labels other than model_name) -> value; every sample names the model."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name", None) == SERVED, sample
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items()))
            samples[key] = sample.value
    return samples


def test_metrics_add_up_over_finished_requests(server: Server) -> None:
    image = image_part(data_url(png_bytes(56, 56, seed=5)))
    jobs = [
        (user("Hello there"), 3),
        (user(image, "What is in the picture?"), 5),
        (user("Count to ten slowly please"), 8),
        (user(image, "Again, what is in it?"), 2),
        (user("One more"), 6),
        (user("And the last one, a little longer than the others"), 4),
    ]
    # Concurrent: requests queue behind each other, so queue times are not all ~0.
    with ThreadPoolExecutor(max_workers=3) as pool:
        usages = list(pool.map(lambda job: _ask(server, job), jobs))
    wait_until_idle(server.url)
    m = _scrape(server)
    num_requests = len(jobs)
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    generation_tokens = sum(u.completion_tokens for u in usages)

    for name in HISTOGRAM_NAMES:
        if name != "inter_token_latency_seconds":  # one per token after the first
            assert m[f"mmserve_{name}_count"] == num_requests, name
    assert m["mmserve_prompt_tokens_total"] == prompt_tokens
    assert m["mmserve_generation_tokens_total"] == generation_tokens
    assert m["mmserve_request_prompt_tokens_sum"] == prompt_tokens
    assert m["mmserve_request_generation_tokens_sum"] == generation_tokens
    success = {r: m[f"mmserve_request_success_total{{finished_reason={r}}}"] for r in
               ("stop", "length", "abort", "error")}  # fmt: skip
    assert success["abort"] == success["error"] == 0
    assert success["stop"] + success["length"] == num_requests
    assert m["mmserve_requests_finished_total"] == num_requests

    # Each request's phases lie inside its end-to-end latency, so the sums do too.
    e2e = m["mmserve_e2e_request_latency_seconds_sum"]
    queue, prefill, decode, inference = (m[f"mmserve_{name}_sum"] for name in PHASE_HISTOGRAMS[1:])
    assert e2e > 0
    assert 0 <= queue <= e2e
    assert prefill >= 0 and decode >= 0
    assert prefill + decode <= e2e
    assert inference == pytest.approx(prefill + decode, abs=1e-6)
    assert queue + inference <= e2e + 1e-6
    assert m["mmserve_time_to_first_token_seconds_sum"] >= queue + prefill - 1e-6
    for name in TOKEN_HISTOGRAMS:
        assert m[f"mmserve_{name}_bucket{{le=+Inf}}"] == num_requests

    # Idle now: nothing holds KV blocks; the tiny pool never had to preempt.
    assert m["mmserve_kv_cache_usage_perc"] == 0.0
    assert m["mmserve_num_preemptions_total"] == 0
