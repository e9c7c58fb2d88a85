"""The disaggregation report's arithmetic on a canned run: bytes per image token, the KV the
same tokens take, their ratio, B/A medians, and the exactness check of the shipped bytes."""

from __future__ import annotations

import json

import pytest

from benchmarks import disagg_report

QWEN2_VL_7B = disagg_report.QWEN2_VL_7B

# make_tiny_qwen2vl.py's config.json as transformers 5 writes it (text fields nested)
TINY_CONFIG = {
    "text_config": {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "vision_config": {"hidden_size": 128, "patch_size": 14, "spatial_merge_size": 2},
}
ENCODERS = ("http://127.0.0.1:1", "http://127.0.0.1:3")
TINY = disagg_report.ModelShape("tiny", 128, 2, 2, 32, "bfloat16")


def bench(req_s: float, ttft_ms: float) -> dict:
    return {
        "request_throughput": req_s,
        "output_throughput": 16 * req_s,
        "ttft_p50_ms": ttft_ms,
        "ttft_p99_ms": 2 * ttft_ms,
        "e2el_p50_ms": ttft_ms + 100,
        "completed": 8,
        "num_requests": 8,
    }


def run(deployment: str, round_idx: int, req_s: float, ttft_ms: float, **lm) -> dict:
    """8 images a run: 4 of 448x448 (256 tokens) and 4 of 224x224 (64): 1,280 tokens."""
    num_tokens = 4 * 256 + 4 * 64
    remote = deployment == "B"
    received = num_tokens * 256 if remote else 0  # 128 hidden x 2 bytes
    lm_metrics = {
        "embedding_bytes_received": received,
        "embedding_bytes_sent": 80_000 if remote else 0,
        "local_items_encoded": 0 if remote else 8,
        "retries": 0,
        "fallbacks": 0,
        "dropped_messages": 0,
        "remote_items": {"http://127.0.0.1:1": 5, "http://127.0.0.1:3": 3} if remote else {},
        "remote_latency_s": {"http://127.0.0.1:1": 1.0, "http://127.0.0.1:3": 0.3}
        if remote
        else {},
        **lm,
    }
    sent = lm_metrics["embedding_bytes_received"]
    return {
        "round": round_idx,
        "workload": "1 image/request",
        "deployment": deployment,
        "seed": 1000 * round_idx,
        "bench": bench(req_s, ttft_ms),
        "images": {"num_images": 8, "num_image_tokens": num_tokens},
        "lm": lm_metrics,
        "encoders": {
            ENCODERS[0]: {"sent_bytes": sent, "items_encoded": 5, "forward_calls": 2},
            ENCODERS[1]: {"sent_bytes": 0, "items_encoded": 3, "forward_calls": 1},
        }
        if remote
        else {},
    }


def document(runs: list[dict]) -> dict:
    return {
        "date": "2026-12-01 21:00 UTC",
        "commit": "abc1234",
        "host": "x86_64, 2 CPUs",
        "checkpoint": "/tmp/tiny (bfloat16)",
        "command": "python benchmarks/disagg_compare.py",
        "model": TINY._asdict(),
        "workloads": [
            {
                "name": "1 image/request",
                "images_per_request": 1,
                "image_sizes": [[448, 448], [224, 224]],
            },
        ],  # fmt: skip
        "runs": runs,
    }


def test_bytes_per_token_of_the_tiny_checkpoint_and_of_qwen2_vl_7b() -> None:
    assert disagg_report.model_shape("tiny", TINY_CONFIG, "bfloat16") == TINY
    flat = {**TINY_CONFIG["text_config"], "vision_config": TINY_CONFIG["vision_config"]}
    assert disagg_report.model_shape("tiny", flat, "bfloat16") == TINY  # transformers 4 layout
    assert (TINY.embedding_bytes_per_token, TINY.kv_bytes_per_token) == (256, 512)
    assert TINY.embedding_to_kv_ratio == 0.5
    # the figures: 7 KiB of embedding against 56 KiB of KV per token
    assert QWEN2_VL_7B.embedding_bytes_per_token == 7 * 1024
    assert QWEN2_VL_7B.kv_bytes_per_token == 56 * 1024
    assert QWEN2_VL_7B.embedding_to_kv_ratio == 0.125
    fp32 = disagg_report.model_shape("tiny", TINY_CONFIG, "float32")
    assert (fp32.embedding_bytes_per_token, fp32.kv_bytes_per_token) == (512, 1024)


def test_deepstack_levels_ship_one_more_row_each() -> None:
    """A Qwen3-VL-style config with 3 DeepStack levels ships 4 rows' worth per image token."""
    vision = {**TINY_CONFIG["vision_config"], "deepstack_visual_indexes": [0, 1, 2]}
    deep = disagg_report.model_shape("tiny", {**TINY_CONFIG, "vision_config": vision}, "bfloat16")
    assert deep.deepstack_levels == 3
    assert deep.embedding_bytes_per_token == 128 * (1 + 3) * 2
    assert deep.kv_bytes_per_token == TINY.kv_bytes_per_token
    assert disagg_report.shape_of({"model": deep._asdict()}) == deep


def test_image_tokens_come_from_the_merged_grid() -> None:
    assert TINY.image_tokens(448, 448) == 16 * 16
    assert TINY.image_tokens(224, 224) == 8 * 8
    assert TINY.image_tokens(448, 224) == 16 * 8
    with pytest.raises(ValueError, match="multiples of 28"):
        TINY.image_tokens(450, 448)


def test_transfer_totals_and_the_exactness_check() -> None:
    runs = [run("A", 1, 4.0, 500), run("B", 1, 5.0, 300), run("B", 2, 6.0, 250)]
    totals = disagg_report.transfer_totals(runs, TINY)
    assert totals.num_images == 16 and totals.num_image_tokens == 2 * 1280
    assert totals.received_bytes == 2 * 1280 * 256
    assert totals.bytes_per_image == 1280 * 256 / 8
    assert totals.bytes_per_image_token == 256
    assert totals.kv_bytes_per_image_token == 512
    assert totals.measured_ratio == 0.5
    assert totals.num_exact_runs == 2

    # a local fallback: one 448x448 image's bytes never crossed the wire
    short = run("B", 3, 5.0, 300, embedding_bytes_received=(1280 - 256) * 256, fallbacks=1)
    check = disagg_report.transfer_check(short, TINY)
    assert check.expected_bytes == 1280 * 256 and not check.is_exact
    assert disagg_report.transfer_totals([*runs, short], TINY).num_exact_runs == 2
    assert disagg_report.transfer_totals([runs[0]], TINY) is None  # no B run


def test_markdown_medians_and_ratios() -> None:
    runs = [
        run("A", 1, 4.0, 500), run("B", 1, 5.0, 300),
        run("B", 2, 7.0, 200), run("A", 2, 6.0, 700),
    ]  # fmt: skip
    a = disagg_report.medians(runs, "1 image/request", "A")
    b = disagg_report.medians(runs, "1 image/request", "B")
    assert a["request_throughput"] == 5.0 and b["request_throughput"] == 6.0
    assert a["ttft_p50_ms"] == 600 and b["ttft_p50_ms"] == 250

    text = disagg_report.markdown(json.loads(json.dumps(document(runs))))
    assert "| Request throughput (req/s) | 5.00 | 6.00 | 1.20x |" in text
    assert "| TTFT p50 (ms) | 600 | 250 | 0.42x |" in text
    assert "| Embedding / KV | 0.500 | 0.125 |" in text
    assert "| 448x448 | 256 | 64 KiB / 128 KiB | 1.75 MiB / 14.00 MiB |" in text
    assert "256.0 per image token against 512 KV bytes" in text
    assert "exactly, in 2 of 2 runs" in text
    assert "A 16 of 16 in the serve process; B 0 of 16" in text
    assert "encode0 10 images (mean send-to-answer 200 ms)" in text
