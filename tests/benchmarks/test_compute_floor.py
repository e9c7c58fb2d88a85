"""compute_floor.py on a tiny checkpoint: the floor adds up from the model's phases, and with
--serve the server ran the same requests and its CPU time is split by process."""

from __future__ import annotations

import importlib
import json
import socket
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TINY = ["--num-prompts", "3", "--concurrency", "2", "--image-size", "56", "--output-len", "3"]


@pytest.fixture
def compute_floor(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("compute_floor")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_floor(floor: dict) -> None:
    assert floor["num_requests"] == 3
    phases = floor["phases_s"]
    # every phase of the model's work was seen: the images, both kinds of step, the sampler
    assert all(phases[p] > 0 for p in ("vit", "lm_prefill", "lm_decode", "logits", "sampling"))
    assert floor["floor_s"] == pytest.approx(sum(phases.values()))
    assert floor["floor_s"] + floor["runner_host_s"] + floor["core_overhead_s"] == pytest.approx(
        floor["wall_s"]
    )
    assert 0 < floor["floor_s"] <= floor["wall_s"]
    assert floor["floor_cpu_s"] == pytest.approx(sum(floor["phases_cpu_s"].values()))
    assert floor["phases_cpu_s"]["vit"] > 0
    # 3 requests of 3 tokens: the first token comes from a prefill step, the other two decode;
    # with 2 in flight the third request's prefill joins a step of its own or a decode's
    assert floor["num_decode_steps"] >= 2 and floor["num_prefill_steps"] >= 2


def test_the_floor_of_a_tiny_workload(
    compute_floor: ModuleType, qwen2_vl_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "floor.json"
    argv = ["--model", str(qwen2_vl_dir), "--dtype", "float32", *TINY, "--json", str(out)]
    assert compute_floor.main(argv) == 0
    result = json.loads(out.read_text())
    check_floor(result["floor"])
    assert result["args"]["dtype"] == "float32" and "serve" not in result


def test_repeated_images_are_encoded_once(
    compute_floor: ModuleType, qwen2_vl_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "floor.json"
    argv = ["--model", str(qwen2_vl_dir), *TINY, "--num-prompts", "8", "--json", str(out)]
    assert compute_floor.main([*argv, "--workload", "repeated-image"]) == 0
    repeated = json.loads(out.read_text())["floor"]
    assert compute_floor.main(argv) == 0
    fresh = json.loads(out.read_text())["floor"]
    assert repeated["num_requests"] == fresh["num_requests"] == 8
    # 4 of 8 images resent: fewer patches through the vision tower, so fewer ViT calls' worth
    # of steps carry images; the request counts match, so the per-request work is comparable
    assert repeated["vit_items"] == 4 and fresh["vit_items"] == 8


@pytest.mark.slow  # a whole server for a benchmark's reporting; the floor itself runs above
def test_serve_runs_the_same_requests_and_splits_cpu_by_process(
    compute_floor: ModuleType, qwen2_vl_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "floor.json"
    argv = ["--model", str(qwen2_vl_dir), *TINY, "--serve", "--port", str(free_port())]
    assert compute_floor.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    served = result["serve"]
    assert served["completed"] == served["num_requests"] == 3
    cpu = served["cpu_s"]
    assert cpu["api"] > 0 and cpu["engine"] > 0 and cpu["client"] > 0
    efficiency = result["efficiency"]
    assert 0 < efficiency["serving_efficiency"] < 1
    assert efficiency["e2e_ms_per_request"] == pytest.approx(
        1000 * served["duration_s"] / served["completed"]
    )
