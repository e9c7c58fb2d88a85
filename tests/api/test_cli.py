"""`mmserve serve` flags → engine and server configs, errors that name the flag, the status line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mmserve.cli import build_parser
from mmserve.config.model import TOY_MODEL_NAME, bundled_toy_model_dir
from mmserve.metrics import EngineMetrics
from tests.support.config_args import args_of, configs_of


def test_defaults_serve_the_bundled_toy_model() -> None:
    args = args_of()
    assert Path(args.model) == Path(bundled_toy_model_dir())
    assert args.resolved_served_model_name == TOY_MODEL_NAME
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert args.enable_prefix_caching and not args.disable_chunked_mm_input


def test_every_flag_reaches_its_field(tmp_path: Path) -> None:
    model = tmp_path / "Qwen2-VL-tiny"
    model.mkdir()
    args = args_of(
        "--model", str(model), "--port", "9001", "--max-num-batched-tokens", "4096",
        "--max-num-seqs", "8", "--max-model-len", "2048", "--block-size", "32",
        "--no-enable-prefix-caching", "--disable-chunked-mm-input",
        "--limit-mm-per-prompt", '{"image": 2}', "--mm-processor-kwargs", '{"max_pixels": 50176}',
        "--allowed-media-domains", "a.example,B.example", "c.example",
        "--allowed-local-media-path", str(tmp_path), "--api-key", "sk-zebra", "--dtype", "float32",
        "--device", "cpu", "--seed", "7", "--encoder-cache-size", "5000",
        "--num-gpu-blocks-override", "100", "--hash-algorithm", "sha256",
        "--media-fetch-timeout", "2.5", "--max-media-bytes", "1000",
        "--max-request-body-bytes", "2000", "--mm-processor-cache-gb", "0",
        "--max-concurrent-media-fetches", "3", "--trust-exif-image-id",
    )  # fmt: skip
    assert args.resolved_served_model_name == str(model)  # the model string, as vLLM names it
    assert (args.port, args.max_num_batched_tokens, args.max_num_seqs) == (9001, 4096, 8)
    assert (args.max_model_len, args.block_size) == (2048, 32)
    assert not args.enable_prefix_caching and args.disable_chunked_mm_input
    assert args.limit_mm_per_prompt == {"image": 2}
    assert args.mm_processor_kwargs == {"max_pixels": 50176}
    assert args.allowed_media_domains == ("a.example", "b.example", "c.example")
    assert args.api_key == ("sk-zebra",) and "sk-zebra" not in repr(args)
    assert (args.dtype, args.device, args.seed, args.hash_algorithm) == (
        "float32",
        "cpu",
        7,
        "sha256",
    )
    assert (args.encoder_cache_size, args.num_gpu_blocks_override) == (5000, 100)
    assert (args.media_fetch_timeout, args.max_media_bytes) == (2.5, 1000)
    assert (args.max_request_body_bytes, args.mm_processor_cache_gb) == (2000, 0.0)
    assert (args.max_concurrent_media_fetches, args.trust_exif_image_id) == (3, True)
    assert not args_of().trust_exif_image_id
    budgets = args_of("--encoder-patch-budget", "4096", "--encoder-cache-bytes", "1000000")
    assert (budgets.encoder_patch_budget, budgets.encoder_cache_bytes) == (4096, 1_000_000)
    assert args_of("--allowed-media-domains", "[::1]:81").allowed_media_domains == ("[::1]:81",)
    assert args_of("--served-model-name", "x").resolved_served_model_name == "x"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--block-size", "-1"], "--block-size"),
        (["--num-gpu-blocks-override", "4", "--kv-cache-memory-bytes", "9"], "--kv-cache"),
        (["--limit-mm-per-prompt", '{"image": -1}'], "--limit-mm-per-prompt"),
        (["--media-fetch-timeout", "0"], "--media-fetch-timeout"),
        (["--port", "70000"], "--port"),
        (["--max-concurrent-media-fetches", "0"], "--max-concurrent-media-fetches"),
        (["--allowed-media-domains", "a.example:http"], "--allowed-media-domains"),
        (["--encoder-patch-budget", "0"], "--encoder-patch-budget"),
        (["--encoder-cache-bytes", "-5"], "--encoder-cache-bytes"),
        (["--encoder-cache-size", "8", "--encoder-cache-bytes", "9"], "--encoder-cache"),
    ],
)
def test_invalid_values_name_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        args_of(*argv)


def test_bad_json_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser(with_bench=False).parse_args(["serve", "--limit-mm-per-prompt", "{image"])
    assert exc.value.code == 2
    assert "--limit-mm-per-prompt must be a JSON object" in capsys.readouterr().err


def test_serve_help_explains_flags_without_heavy_imports() -> None:
    code = (
        "import sys; from mmserve.cli import main\n"
        "try: main(['serve', '--help'])\n"
        "except SystemExit: pass\n"
        "heavy = [m for m in ('torch', 'mmserve.bench.cli', 'mmserve.engine.factory') "
        "if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert "--encoder-cache-size" in out and "embedding slots" in out
    assert "--encoder-patch-budget" in out and "Input patches" in out
    assert "--encoder-cache-bytes" in out
    assert "HEAVY []" in out


def test_status_line_only_when_something_changed() -> None:
    from mmserve.api.status import format_status

    metrics = EngineMetrics()
    before = metrics.snapshot()
    assert format_status(before, metrics.snapshot(), 5.0) is None
    metrics.inc("generation_tokens", 50)
    metrics.inc("encoder_cache_queries", 4)
    metrics.inc("encoder_cache_hits", 3)
    metrics.set_gauge("num_requests_running", 2)
    metrics.set_gauge("kv_blocks_total", 40)
    metrics.set_gauge("kv_blocks_free", 30)
    metrics.inc("num_preemptions", 3)
    line = format_status(before, metrics.snapshot(), 5.0)
    assert line is not None
    assert "running: 2 reqs" in line and "generation: 10.0 tok/s" in line
    assert "encoder 75.0%" in line and "prefix -" in line
    assert "KV blocks free: 30/40 (usage 25.0%)" in line and "preemptions: 3" in line


def test_http_timeout_flags_reach_their_fields_and_refuse_nonsense() -> None:
    args = args_of(
        "--http-header-timeout", "2.5", "--http-body-timeout", "30",
        "--http-keep-alive-timeout", "1",
    )  # fmt: skip
    assert (args.http_header_timeout, args.http_body_timeout) == (2.5, 30.0)
    assert args.http_keep_alive_timeout == 1.0
    defaults = args_of()
    assert (defaults.http_header_timeout, defaults.http_body_timeout) == (10.0, 60.0)
    assert defaults.http_keep_alive_timeout == 5.0
    for field in ("http_header_timeout", "http_body_timeout", "http_keep_alive_timeout"):
        for bad in (0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="--" + field.replace("_", "-")):
                configs_of(**{field: bad})


def test_decode_memory_flags_reach_their_fields_and_are_checked() -> None:
    defaults = args_of()
    assert defaults.max_image_pixels is None  # resolved by the factory from the processor
    assert (defaults.max_decode_bytes_per_request, defaults.max_inflight_decode_bytes) == (
        1 << 30,
        2 << 30,
    )
    assert (defaults.decode_wait_timeout, defaults.decode_worker_max_rss_mb) == (10.0, 1024)
    args = args_of(
        "--max-image-pixels", "1000000", "--max-decode-bytes-per-request", "5000",
        "--max-inflight-decode-bytes", "9000", "--decode-wait-timeout", "2.5",
        "--decode-worker-max-rss-mb", "0",
    )  # fmt: skip
    assert (args.max_image_pixels, args.max_decode_bytes_per_request) == (1_000_000, 5000)
    assert (args.max_inflight_decode_bytes, args.decode_wait_timeout) == (9000, 2.5)
    assert args.decode_worker_max_rss_mb == 0
    with pytest.raises(ValueError, match="--max-decode-bytes-per-request"):
        args_of("--max-decode-bytes-per-request", "5000", "--max-inflight-decode-bytes", "10")


def test_the_model_may_be_positional_as_in_vllm(tmp_path: Path) -> None:
    model = tmp_path / "ckpt"
    model.mkdir()
    args = args_of(str(model), "--max-model-len", "512")
    assert (args.model, args.max_model_len) == (str(model), 512)
    assert args.served_model_names == (str(model),)
    relative = args_of("some/relative/dir")
    assert relative.resolved_served_model_name == "some/relative/dir"  # as given, unresolved


def test_the_model_given_twice_differently_is_a_usage_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mmserve", "serve", str(tmp_path), "--model", "/elsewhere"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "the model is given twice" in proc.stderr


def test_several_served_model_names_first_one_answers() -> None:
    args = args_of("--served-model-name", "qwen", "qwen-vl", "qwen")
    assert args.served_model_names == ("qwen", "qwen-vl")  # repeats dropped, order kept
    assert args.resolved_served_model_name == "qwen"
    with pytest.raises(ValueError, match="--served-model-name must not be empty"):
        configs_of(served_model_name=("qwen", " "))
