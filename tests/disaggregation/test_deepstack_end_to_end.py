"""Qwen3-VL (DeepStack) disaggregated for real: `mmserve encode` and `mmserve serve
--encoder-urls` subprocesses give the monolithic engine's greedy answers, through the pool and
through the local fallback, and every DeepStack level crosses the wire: the bytes received are
tokens x hidden x (1 + levels) x dtype size."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mmserve.engine.frontend.llm import LLM
from mmserve.models.config import load_model_config
from mmserve.sampling_params import SamplingParams
from tests.disaggregation.harness import Encoder, metric_sum
from tests.support.factory import png_bytes, write_tiny_checkpoint
from tests.support.harness import Server, data_url, image_part, read_metrics, user

MAX_TOKENS = 8
TIMEOUT_S = 10.0  # --encoder-timeout: long enough that a loaded machine never retries
RECEIVED = 'mmserve_embedding_transfer_bytes_total{direction="received"}'


@pytest.fixture(scope="module")
def qwen3_vl_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3_vl_disagg")
    try:
        return write_tiny_checkpoint(out, "qwen3_vl", seed=3)
    except ValueError as exc:
        if "unknown arch" not in str(exc):
            raise
        pytest.skip(
            "no Qwen3-VL checkpoint builder here: tests/support/factory.py "
            "write_tiny_checkpoint(arch='qwen3_vl') comes with the Qwen3-VL model (issue #33)"
        )


@pytest.fixture(scope="module")
def deployment(qwen3_vl_checkpoint: Path, tmp_path_factory) -> Iterator[dict]:
    """One encoder and one language server that falls back to local encoding."""
    logs = tmp_path_factory.mktemp("deepstack_logs")
    encoder = Encoder(qwen3_vl_checkpoint, logs / "enc.log").wait_ready()
    args = ["--encoder-urls", encoder.url, "--encoder-timeout", str(TIMEOUT_S)]
    lm = Server(qwen3_vl_checkpoint, logs / "lm.log", *args, "--max-num-batched-tokens", "32")
    yield {"encoder": encoder, "lm": lm}
    for proc in (lm, encoder):
        proc.stop()


@pytest.fixture(scope="module")
def reference(qwen3_vl_checkpoint: Path) -> Iterator[LLM]:
    with LLM(str(qwen3_vl_checkpoint), max_num_batched_tokens=32) as llm:
        yield llm


def _greedy(reference: LLM, messages: list[dict]) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return reference.chat(messages, params, use_tqdm=False)[0].outputs[0].text


def _ask(server: Server, messages: list[dict]) -> str:
    out = server.client.chat.completions.create(
        model=server.client.models.list().data[0].id,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].message.content


def test_every_deepstack_level_crosses_the_wire_and_the_answer_is_the_monolithic_one(
    deployment, reference, qwen3_vl_checkpoint
) -> None:
    config = load_model_config(qwen3_vl_checkpoint)
    assert config.deepstack_levels > 0, "the tiny Qwen3-VL checkpoint must have DeepStack levels"
    lm, encoder = deployment["lm"], deployment["encoder"]
    sent = "mmserve_encoder_sent_bytes_total"
    before, encoder_before = read_metrics(lm.url), metric_sum(encoder.metrics(), sent)
    messages = user(image_part(data_url(png_bytes(96, 64, seed=1))), "What is in the image?")
    assert _ask(lm, messages) == _greedy(reference, messages)
    after = read_metrics(lm.url)
    merge = config.vision.spatial_merge_size * config.vision.patch_size  # pixels per token side
    num_tokens = (96 // merge) * (64 // merge)
    row_bytes = config.hidden_size * (1 + config.deepstack_levels) * 4  # float32 checkpoint
    assert after[RECEIVED] - before[RECEIVED] == num_tokens * row_bytes
    assert metric_sum(encoder.metrics(), sent) - encoder_before == num_tokens * row_bytes
    assert after["mmserve_encoder_pool_bytes"] >= num_tokens * row_bytes
    # the start-up log states a cache slot's bytes and the levels behind them
    levels = f"hidden {config.hidden_size} x (1 + {config.deepstack_levels} DeepStack levels)"
    assert f"embeddings of {row_bytes} bytes: {levels}" in lm.log_path.read_text()


def test_the_local_fallback_gives_the_same_answer(deployment, reference) -> None:
    lm, encoder = deployment["lm"], deployment["encoder"]
    encoder.kill()  # the pool's only encoder: the language server encodes locally
    fallbacks = "mmserve_remote_encoder_fallbacks_total"
    before = read_metrics(lm.url)
    messages = user(image_part(data_url(png_bytes(64, 128, seed=2))), "Describe it.")
    assert _ask(lm, messages) == _greedy(reference, messages)
    after = read_metrics(lm.url)
    assert after[fallbacks] == before[fallbacks] + 1
    assert after[RECEIVED] == before[RECEIVED]  # nothing came over the wire
