"""The A/B summary: medians over rounds, the mmserve/vLLM and mmserve/baseline ratios, the goal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import ab_summary


def write_result(
    out_dir: Path,
    engine: str,
    concurrency: int,
    round_idx: int,
    req_s: float,
    ttft_ms: float,
    completed: int = 48,
    startup_s: float | None = 5.0,
) -> None:
    """A result file with the fields `vllm bench serve --save-result` writes and we read."""
    stem = ab_summary.result_stem(engine, concurrency, round_idx)
    result = {
        "request_throughput": req_s,
        "median_ttft_ms": ttft_ms,
        "median_tpot_ms": 7.5,
        "completed": completed,
        "failed": 48 - completed,
        "num_prompts": 48,
        "max_concurrency": concurrency,
        "output_throughput": req_s * 32,
    }
    (out_dir / f"{stem}.json").write_text(json.dumps(result))
    if startup_s is not None:
        (out_dir / f"{stem}.server.json").write_text(json.dumps({"startup_s": startup_s}))


def test_medians_over_rounds_and_their_ratio(tmp_path: Path) -> None:
    for round_idx, (vllm, mmserve) in enumerate([(20.0, 30.0), (24.0, 45.0), (22.0, 33.0)], 1):
        write_result(tmp_path, "vllm", 16, round_idx, vllm, ttft_ms=400 + round_idx)
        write_result(tmp_path, "mmserve", 16, round_idx, mmserve, ttft_ms=300 + 10 * round_idx)
    (tmp_path / "summary.json").write_text("{}")  # other files in the dir are not results

    runs = ab_summary.load_runs(tmp_path)
    assert [(r.round_idx, r.engine) for r in runs] == [
        (1, "vllm"), (1, "mmserve"), (2, "vllm"), (2, "mmserve"), (3, "vllm"), (3, "mmserve")
    ]  # fmt: skip
    [summary] = ab_summary.summarize(runs)
    assert summary.median_throughput == {"vllm": 22.0, "mmserve": 33.0}
    assert summary.throughput_ratio == pytest.approx(1.5)
    assert summary.median_ttft_ms == {"vllm": 402, "mmserve": 320}
    assert summary.num_rounds == {"vllm": 3, "mmserve": 3}
    assert summary.is_complete and summary.is_goal_met
    assert "1.50x" in ab_summary.format_summary(summary)


def test_goal_needs_throughput_ttft_and_every_request(tmp_path: Path) -> None:
    write_result(tmp_path, "vllm", 1, 1, 10.0, ttft_ms=100)
    write_result(tmp_path, "mmserve", 1, 1, 14.0, ttft_ms=90)  # 1.4x: too slow
    write_result(tmp_path, "vllm", 16, 1, 10.0, ttft_ms=100)
    write_result(tmp_path, "mmserve", 16, 1, 20.0, ttft_ms=101)  # fast, but later first token
    write_result(tmp_path, "vllm", 64, 1, 10.0, ttft_ms=100)
    write_result(tmp_path, "mmserve", 64, 1, 20.0, ttft_ms=90, completed=40)  # 8 failed

    by_concurrency = {
        s.concurrency: s for s in ab_summary.summarize(ab_summary.load_runs(tmp_path))
    }
    assert not any(s.is_goal_met for s in by_concurrency.values())
    assert [s.is_complete for s in by_concurrency.values()] == [True, True, False]
    assert "some requests failed" in ab_summary.format_summary(by_concurrency[64])


def test_report_names_a_concurrency_without_both_engines(tmp_path: Path) -> None:
    write_result(tmp_path, "vllm", 16, 1, 20.0, ttft_ms=400)
    write_result(tmp_path, "mmserve", 16, 1, 30.0, ttft_ms=300)
    write_result(tmp_path, "vllm", 64, 1, 25.0, ttft_ms=900, startup_s=None)  # mmserve never ran

    lines = ab_summary.report(ab_summary.load_runs(tmp_path))
    assert len(lines) == 5  # three runs, one summary, one incomplete
    assert "start-up 5 s" in lines[0] and "start-up" not in lines[2]
    assert lines[-1].startswith("c=64: incomplete")


def test_summary_json_holds_runs_medians_and_context(tmp_path: Path) -> None:
    write_result(tmp_path, "vllm", 16, 1, 20.0, ttft_ms=400)
    write_result(tmp_path, "mmserve", 16, 1, 30.0, ttft_ms=300)
    path = tmp_path / "summary.json"

    ab_summary.write_summary(path, ab_summary.load_runs(tmp_path), {"vllm": "0.32.0+cpu"})
    document = json.loads(path.read_text())
    assert document["vllm"] == "0.32.0+cpu"
    assert [r["engine"] for r in document["runs"]] == ["vllm", "mmserve"]
    assert document["by_concurrency"][0]["throughput_ratio"] == pytest.approx(1.5)
    assert document["runs"][0]["startup_s"] == 5.0


def test_a_misnamed_result_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "sglang-c16-r1.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="engine-cN-rM"):
        ab_summary.load_run(path)


def test_a_baseline_adds_a_second_ratio(tmp_path: Path) -> None:
    for round_idx, (vllm, base, mmserve) in enumerate([(20, 30, 33), (22, 40, 36)], 1):
        write_result(tmp_path, "vllm", 16, round_idx, vllm, ttft_ms=400)
        write_result(tmp_path, "mmserve-base", 16, round_idx, base, ttft_ms=300 + round_idx)
        write_result(tmp_path, "mmserve", 16, round_idx, mmserve, ttft_ms=290 + round_idx)

    runs = ab_summary.load_runs(tmp_path)
    assert [r.engine for r in runs[:3]] == ["vllm", "mmserve-base", "mmserve"]
    [summary] = ab_summary.summarize(runs)
    assert summary.median_throughput == {"vllm": 21, "mmserve-base": 35, "mmserve": 34.5}
    assert summary.throughput_ratio == pytest.approx(34.5 / 21)
    assert summary.base_throughput_ratio == pytest.approx(34.5 / 35)
    assert summary.median_ttft_ms == {"vllm": 400, "mmserve-base": 301.5, "mmserve": 291.5}
    assert summary.is_goal_met

    vs_vllm, vs_base = ab_summary.report(runs)[-2:]
    assert vs_vllm.startswith("c=16: mmserve/vllm request throughput 1.64x") and "goal" in vs_vllm
    assert vs_base == (
        "c=16: mmserve/mmserve-base request throughput 0.99x (medians over 2 rounds: "
        "mmserve 34.50, mmserve-base 35.00 req/s); TTFT p50 mmserve 292 ms, mmserve-base 302 ms"
    )


def test_without_vllm_only_the_baseline_ratio_is_given(tmp_path: Path) -> None:
    write_result(tmp_path, "mmserve-base", 4, 1, 10.0, ttft_ms=100)
    write_result(tmp_path, "mmserve", 4, 1, 11.0, ttft_ms=90, completed=47)
    write_result(tmp_path, "mmserve-base", 16, 1, 12.0, ttft_ms=100)  # mmserve never ran

    runs = ab_summary.load_runs(tmp_path)
    [summary] = ab_summary.summarize(runs)
    assert summary.throughput_ratio is None and summary.is_goal_met is None
    assert summary.base_throughput_ratio == pytest.approx(1.1)
    assert summary.num_rounds == {"mmserve-base": 1, "mmserve": 1}

    lines = ab_summary.report(runs)
    assert len(lines) == 5  # three runs, one ratio, one incomplete
    assert lines[3].startswith("c=4: mmserve/mmserve-base request throughput 1.10x")
    assert lines[3].endswith("some requests failed, see the runs above")
    assert "vllm" not in "".join(lines)
    assert lines[4] == "c=16: incomplete, no result from mmserve"

    path = tmp_path / "summary.json"
    ab_summary.write_summary(path, runs, {"mmserve": "/after", "mmserve-base": "/before"})
    document = json.loads(path.read_text())
    assert document["mmserve-base"] == "/before"
    [by_concurrency] = document["by_concurrency"]
    assert by_concurrency["base_throughput_ratio"] == pytest.approx(1.1)
    assert by_concurrency["throughput_ratio"] is None
    assert by_concurrency["median_ttft_ms"] == {"mmserve-base": 100, "mmserve": 90}
    assert [r["engine"] for r in document["runs"]] == ["mmserve-base", "mmserve", "mmserve-base"]
