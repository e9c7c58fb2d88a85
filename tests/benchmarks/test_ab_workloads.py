"""compare_vllm_cpu.py on equal terms: one dtype for every engine (native bf16 or float32), and
the repeated-image workload's results read like vLLM's."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw\n"
SAPPHIRE_RAPIDS = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("compare_vllm_cpu")


@pytest.fixture
def workloads(harness: ModuleType) -> ModuleType:
    return importlib.import_module("ab_workloads")


def settings(harness: ModuleType, argv: list[str], environ: dict[str, str] | None = None):
    return harness.settings_from(harness.parse_args(["run", *argv], environ or {}, "test"))


def test_float32_without_native_bf16_and_bfloat16_with_it(workloads: ModuleType) -> None:
    dtype, why = workloads.default_dtype(AVX2_ONLY)
    assert dtype == "float32" and "emulated" in why
    dtype, why = workloads.default_dtype(SAPPHIRE_RAPIDS)
    assert dtype == "bfloat16" and "amx_bf16, avx512_bf16" in why
    assert workloads.default_dtype("")[0] == "float32"  # no flags line: not an x86 we know


def test_both_engines_get_the_same_dtype(harness: ModuleType, tmp_path: Path) -> None:
    s = settings(harness, ["--dtype", "bfloat16", "--mmserve-args", "--max-num-seqs 8"])
    assert (s.dtype, s.workload) == ("bfloat16", "random-mm")
    vllm_cmd, _ = harness.vllm_command(s, tmp_path)
    mmserve_cmd, _ = harness.mmserve_command(s, tmp_path, "mmserve")
    for cmd in (vllm_cmd, mmserve_cmd):
        assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
        assert cmd.count("--dtype") == 1


def test_auto_reads_this_cpu(harness: ModuleType, workloads: ModuleType) -> None:
    expected = workloads.default_dtype(workloads.read_cpuinfo())
    s = settings(harness, [], {})
    assert (s.dtype, s.dtype_reason) == expected
    assert settings(harness, [], {"DTYPE": "float32"}).dtype == "float32"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtype", "float16"], "DTYPE must be auto"),
        (["--workload", "sharegpt"], "WORKLOAD must be one of"),
        (["--mmserve-args", "--dtype bfloat16"], "MMSERVE_ARGS sets --dtype"),
        (["--vllm-args=--dtype=float32"], "VLLM_ARGS sets --dtype"),
    ],
)
def test_refusals(harness: ModuleType, argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings(harness, argv)


def test_repeated_image_is_sent_by_mmserve_bench_to_every_engine(
    harness: ModuleType, workloads: ModuleType, tmp_path: Path
) -> None:
    assert workloads.client_of("random-mm") == "vllm"
    assert workloads.client_of("repeated-image") == "mmserve"
    cmd = workloads.mmserve_bench_command(
        "/py", "http://127.0.0.1:9", "/m", 48, 16, 1016, tmp_path / "r.json"
    )
    assert cmd[:5] == ["/py", "-m", "mmserve", "bench", "serve"]
    flags = dict(zip(cmd[5::2], cmd[6::2], strict=False))
    assert flags["--repeat-ratio"] == "0.5" and flags["--max-concurrency"] == "16"
    assert flags["--seed"] == "1016" and flags["--model"] == "/m"


def test_mmserve_bench_results_read_as_vllm_bench_results(
    harness: ModuleType, workloads: ModuleType, tmp_path: Path
) -> None:
    summary = importlib.import_module("ab_summary")
    raw = tmp_path / "mmserve-c16-r1.mmserve-bench.json"
    raw.write_text(
        json.dumps(
            {
                "request_throughput": 12.5,
                "completed": 47,
                "num_requests": 48,
                "ttft": {"p50_ms": 700.0, "mean_ms": 1.0},
                "tpot": None,
                "workload": {"num_repeated_images": 24},
            }
        )
    )
    workloads.write_vllm_result(raw, tmp_path / "mmserve-c16-r1.json")
    run = summary.load_run(tmp_path / "mmserve-c16-r1.json")
    assert (run.request_throughput, run.median_ttft_ms) == (12.5, 700.0)
    assert (run.num_completed, run.num_prompts) == (47, 48)
    assert math.isnan(run.median_tpot_ms)


def test_an_ab_of_flags_may_share_one_checkout(
    harness: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mmserve").mkdir()
    (tmp_path / "mmserve" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    argv = ["--mmserve-py", sys.executable, "--mmserve-base-py", sys.executable]
    argv += ["--mmserve-args=--max-num-batched-tokens 2048"]
    with pytest.raises(harness.HarnessError, match="MMSERVE_BASE_ARGS"):
        harness.mmserve_locations(settings(harness, argv))
    s = settings(harness, [*argv, "--mmserve-base-args=--max-num-batched-tokens 8192"])
    assert set(harness.mmserve_locations(s)) == {"mmserve-base", "mmserve"}
    base_cmd, _ = harness.mmserve_command(s, tmp_path, "mmserve-base")
    cmd, _ = harness.mmserve_command(s, tmp_path, "mmserve")
    assert base_cmd[-2:] == ["--max-num-batched-tokens", "8192"]
    assert cmd[-2:] == ["--max-num-batched-tokens", "2048"]
    with pytest.raises(ValueError, match="MMSERVE_BASE_ARGS sets --dtype"):
        settings(harness, [*argv, "--mmserve-base-args=--dtype bfloat16"])


def test_the_mmserve_client_warms_each_server_up_on_other_images(
    harness: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like `vllm bench serve`'s test request: a warm-up run before the measured one, with
    another seed (other images), and the measured run's result in vLLM's keys."""
    commands: list[list[str]] = []

    def run(cmd: list[str], **_kwargs):  # stands in for the client: writes what it would
        commands.append(cmd)
        out = Path(cmd[cmd.index("--result-json") + 1])
        result = {"request_throughput": 3.0, "completed": 4, "num_requests": 4, "ttft": None}
        out.write_text(json.dumps(result))
        return harness.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(harness.subprocess, "run", run)
    s = settings(harness, ["--workload", "repeated-image", "--out-dir", str(tmp_path)])
    harness.run_bench(s, tmp_path / "model", 18499, 16, "mmserve-c16-r1", seed=1016)
    warm_up, measured = commands
    flags = [dict(zip(c[5::2], c[6::2], strict=False)) for c in commands]
    assert flags[0]["--seed"] != "1016" and flags[1]["--seed"] == "1016"
    assert flags[0]["--num-prompts"] == "2" and flags[1]["--num-prompts"] == "48"
    assert flags[1]["--max-concurrency"] == "16"
    run_result = json.loads((tmp_path / "mmserve-c16-r1.json").read_text())
    assert run_result["request_throughput"] == 3.0 and run_result["num_prompts"] == 4
