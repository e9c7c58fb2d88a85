"""What compare_vllm_cpu.py measures on equal terms: the dtype both engines run, and the
workloads with the client that sends each one.

Dtype: both servers get the same `--dtype`. A CPU without native bfloat16 arithmetic (no
AVX512-BF16, no AMX-BF16) emulates bfloat16 at several times the cost of float32, so comparing
an engine in bfloat16 with one in float32 there measures the emulation, not the engine: the
default is float32 on such a CPU and bfloat16 where the CPU has it natively.

Workloads (each request one 448x448 image and ~32 text tokens, 32 output tokens with EOS
ignored, all sent at once behind the concurrency cap):

- `random-mm`: vLLM's own `vllm bench serve --dataset-name random-mm`, a new random image per
  request (no cache can help).
- `repeated-image`: half the requests resend an earlier request's exact image bytes, where the
  encoder, processor and prefix caches should pay. `vllm bench serve` cannot send that (its
  random-mm draws a new image per request, and its prefix-repetition dataset is text), so this
  workload is sent by `mmserve bench serve --repeat-ratio 0.5`, the same client for every
  engine, from the venv of MMSERVE_PY, after a warm-up of two requests of other images (vLLM's
  client sends one test request before its clock starts); its result is written in the same
  keys as vLLM's.
"""

from __future__ import annotations

import json
from pathlib import Path

DTYPES = ("float32", "bfloat16")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
RANDOM_MM, REPEATED_IMAGE = "random-mm", "repeated-image"
WORKLOADS = (RANDOM_MM, REPEATED_IMAGE)
REPEAT_RATIO = 0.5
# mmserve bench serve's warm-up before each measured run (vllm bench serve sends its own).
WARM_UP_PROMPTS = 2
WARM_UP_SEED_OFFSET = 7919

# The random-mm workload, as `vllm bench serve` flags; --num-prompts, --max-concurrency and
# --seed vary.
VLLM_BENCH_FLAGS = [
    "--dataset-name", "random-mm",
    "--random-input-len", "32",
    "--random-output-len", "32",
    "--random-range-ratio", "0",
    "--random-mm-base-items-per-request", "1",
    "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
    "--random-mm-bucket-config", "{(448, 448, 1): 1.0}",
    "--request-rate", "inf",
    "--ignore-eos",
]  # fmt: skip
# The repeated-image workload, as `mmserve bench serve` flags (the same shape of request).
MMSERVE_BENCH_FLAGS = [
    "--image-sizes", "448x448",
    "--images-per-request", "1",
    "--repeat-ratio", str(REPEAT_RATIO),
    "--input-len", "32",
    "--output-len", "32",
    "--ignore-eos",
    "--request-rate", "inf",
    "--no-server-metrics",  # vLLM's /metrics names differ; the run's figures are the client's
]  # fmt: skip


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of /proc/cpuinfo's first `flags` line (x86); empty elsewhere."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def default_dtype(cpuinfo: str) -> tuple[str, str]:
    """(dtype, why): bfloat16 where the CPU computes it natively, else float32."""
    native = sorted(set(NATIVE_BF16_FLAGS) & cpu_flags(cpuinfo))
    if native:
        return "bfloat16", f"the CPU has native bfloat16 ({', '.join(native)})"
    return "float32", (
        "the CPU has no native bfloat16 (neither avx512_bf16 nor amx_bf16 in /proc/cpuinfo), "
        "so bfloat16 would be emulated"
    )


def read_cpuinfo(path: Path = Path("/proc/cpuinfo")) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def resolve_dtype(given: str) -> tuple[str, str]:
    """DTYPE as given ("auto": from the CPU's flags) and the reason recorded with it."""
    if given == "auto":
        return default_dtype(read_cpuinfo())
    if given not in DTYPES:
        raise ValueError(f"DTYPE must be auto, {' or '.join(DTYPES)}; got {given!r}")
    return given, "given on the command line or in DTYPE"


def client_of(workload: str) -> str:
    """Which load generator sends a workload: "vllm" (`vllm bench serve`) or "mmserve"."""
    if workload not in WORKLOADS:
        raise ValueError(f"WORKLOAD must be one of {', '.join(WORKLOADS)}; got {workload!r}")
    return "vllm" if workload == RANDOM_MM else "mmserve"


def mmserve_bench_command(
    python: str, base_url: str, model: str, num_prompts: int, concurrency: int, seed: int,
    result_json: Path,
) -> list[str]:  # fmt: skip
    return [
        python, "-m", "mmserve", "bench", "serve", "--base-url", base_url, "--model", model,
        *MMSERVE_BENCH_FLAGS,
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
        "--seed", str(seed), "--disable-tqdm", "--result-json", str(result_json),
    ]  # fmt: skip


def as_vllm_result(mmserve_result: dict) -> dict:
    """`mmserve bench serve`'s result in the keys of `vllm bench serve --save-result` that the
    summary reads (a latency with no sample, as when every request failed, is NaN)."""

    def p50(name: str) -> float:
        stats = mmserve_result.get(name)
        return float(stats["p50_ms"]) if stats else float("nan")

    return {
        "request_throughput": mmserve_result["request_throughput"],
        "median_ttft_ms": p50("ttft"),
        "median_tpot_ms": p50("tpot"),
        "completed": mmserve_result["completed"],
        "num_prompts": mmserve_result["num_requests"],
        "workload": mmserve_result.get("workload"),
        "client": "mmserve bench serve",
    }


def write_vllm_result(mmserve_json: Path, out_json: Path) -> None:
    out_json.write_text(json.dumps(as_vllm_result(json.loads(mmserve_json.read_text()))))
