"""A disaggregated deployment for real: `mmserve encode` and `mmserve serve --encoder-urls`
subprocesses on 127.0.0.1, against the monolithic engine's greedy outputs.

One module, one set of processes (starting them is most of the cost); the fault tests come
last because they stop and kill encoders. After every test the language servers must be idle:
no request, every KV block free, no encoder-cache entry referenced, nothing in flight.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import zmq

from mmserve.engine.frontend.llm import LLM
from mmserve.sampling_params import SamplingParams
from tests.disaggregation.harness import Encoder, metric_sum
from tests.support.factory import png_bytes
from tests.support.harness import Server, data_url, image_part, read_metrics, user
from tests.support.media_server import MediaServer, running_media_server

MAX_TOKENS = 8
TIMEOUT_S = 2.0  # --encoder-timeout of the language servers: the fault tests wait this long

IMAGES = {name: png_bytes(w, h, seed) for name, (w, h, seed) in {
    "small": (56, 84, 1),
    "large": (224, 196, 2),  # 8 x 7 merged tokens per 28 px: 56 placeholders
    "other": (112, 112, 3),
    "fault": (140, 84, 4),
    "fault2": (84, 140, 5),
}.items()}  # fmt: skip
CONVERSATIONS = {
    "one_image": user(image_part(data_url(IMAGES["small"])), "What is in the image?"),
    "two_images": user(
        image_part(data_url(IMAGES["large"])),
        "and",
        image_part(data_url(IMAGES["other"])),
        "Which one is larger?",
    ),
}


@pytest.fixture(scope="module")
def web() -> Iterator[MediaServer]:
    """Serves IMAGES by name (the encoder fetches URL images; the LM never does)."""
    with running_media_server({f"/{name}.png": data for name, data in IMAGES.items()}) as srv:
        yield srv


@pytest.fixture(scope="module")
def deployment(qwen2_vl_dir: Path, web, tmp_path_factory) -> Iterator[dict]:
    """Two encoders; `lm` falls back to local encoding, `lm_fail` answers 503 instead."""
    logs = tmp_path_factory.mktemp("pool_logs")
    policy = ["--allowed-media-domains", f"127.0.0.1:{web.server_port}"]
    encoders = [Encoder(qwen2_vl_dir, logs / f"enc{i}.log", *policy) for i in range(2)]
    for enc in encoders:
        enc.wait_ready()
    urls = [e.url for e in encoders]
    common = ["--encoder-urls", *urls, "--encoder-timeout", str(TIMEOUT_S)]
    common += ["--max-num-batched-tokens", "32"]  # prefill chunks cut through the images
    lm = Server(qwen2_vl_dir, logs / "lm.log", *common)
    lm_fail = Server(qwen2_vl_dir, logs / "lm_fail.log", *common, "--encoder-fallback", "fail")
    yield {"encoders": encoders, "lm": lm, "lm_fail": lm_fail}
    for srv in (lm, lm_fail, *encoders):
        srv.stop()


@pytest.fixture(scope="module")
def reference(qwen2_vl_dir: Path) -> LLM:
    return LLM(str(qwen2_vl_dir), max_num_batched_tokens=32)


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


def _idle(server: Server, timeout_s: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = read_metrics(server.url)
        idle = (
            m["mmserve_num_requests_running"] == 0
            and m["mmserve_num_requests_waiting"] == 0
            and m["mmserve_kv_blocks_free"] == m["mmserve_kv_blocks_total"]
            and m["mmserve_encoder_cache_used_slots"] == 0
            and m.get("mmserve_remote_encoder_items_in_flight", 0) == 0
        )
        if idle:
            return m
        assert time.monotonic() < deadline, f"server did not become idle: {m}"
        time.sleep(0.2)


@pytest.fixture(autouse=True)
def _leaves_nothing_behind(request) -> Iterator[None]:
    yield
    if "deployment" in request.fixturenames:
        dep = request.getfixturevalue("deployment")
        _idle(dep["lm"])
        _idle(dep["lm_fail"])
        for enc in dep["encoders"]:
            if enc.proc.poll() is None:  # not the killed one
                _encoder_idle(enc)


def _encoder_idle(enc: Encoder, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        m = enc.metrics()
        if m["mmserve_encoder_queued_items"] == 0 and m["mmserve_encoder_queued_patches"] == 0:
            return
        assert time.monotonic() < deadline, f"encoder {enc.url} did not drain: {m}"
        time.sleep(0.2)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_outputs_equal_the_monolithic_engine(deployment, reference, name) -> None:
    messages = CONVERSATIONS[name]
    assert _ask(deployment["lm"], messages) == _greedy(reference, messages)


def test_url_images_are_fetched_by_the_encoder(deployment, reference, web) -> None:
    """The LM server plans the URL on the pool and never fetches it (it has no media policy
    that allows the web server: a local fetch would be refused)."""
    url = f"http://127.0.0.1:{web.server_port}/other.png"
    plans = "mmserve_encoder_plan_requests_total"
    before = sum(metric_sum(e.metrics(), plans) for e in deployment["encoders"])
    got = _ask(deployment["lm"], user(image_part(url), "What is in the image?"))
    inline = user(image_part(data_url(IMAGES["other"])), "What is in the image?")
    assert got == _greedy(reference, inline)
    assert sum(metric_sum(e.metrics(), plans) for e in deployment["encoders"]) == before + 1


def test_embeddings_cross_the_wire_not_kv(deployment) -> None:
    before = read_metrics(deployment["lm"].url)
    _ask(deployment["lm"], user(image_part(data_url(png_bytes(84, 56, 9))), "Describe it."))
    after = read_metrics(deployment["lm"].url)
    received = 'mmserve_embedding_transfer_bytes_total{direction="received"}'
    # 84 x 56 px -> 3 x 2 merged tokens, hidden 64, float32 (the tiny checkpoint's dtype)
    assert after[received] - before[received] == 3 * 2 * 64 * 4


# One picture from both language servers, encoded once: test_pool_affinity.py (20 runs, with
# servers whose --encoder-timeout no encode can reach; these time out after 2 s, for the faults).


def test_garbage_frames_to_an_encoder_are_dropped(deployment) -> None:
    enc = deployment["encoders"][1]
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 5000)  # close only once the frames are out
    sock.connect(f"tcp://127.0.0.1:{enc.zmq_port}")
    sock.send_multipart([b"\x00garbage"])
    sock.send_multipart([b"\x81\xa3foo\x01", b"", b""])
    sock.send_multipart([b"\xc1" * 10, b"x" * 100, b""])
    sock.close()
    deadline = time.monotonic() + 10
    while metric_sum(enc.metrics(), "mmserve_encoder_malformed_messages_total") < 3:
        assert time.monotonic() < deadline, enc.metrics()
        time.sleep(0.1)
    messages = CONVERSATIONS["one_image"]
    assert _ask(deployment["lm"], messages) == _ask(deployment["lm_fail"], messages)


# ------------------------------------------------------------ faults (stop and kill encoders)


def _encoders_that_encode(deployment, picture: bytes) -> list[Encoder]:
    """The encoder the pool routes `picture` to (rendezvous hashing on its identity, over URLs
    with random ports): ask `lm_fail` about it alone and see which encoder encoded it. Both
    language servers rank the encoders alike, so `lm` will send the picture there too. (Two,
    if that encode outlasted --encoder-timeout on a loaded machine and was retried.)"""
    encoded = "mmserve_encoder_items_encoded_total"
    before = [metric_sum(e.metrics(), encoded) for e in deployment["encoders"]]
    _ask(deployment["lm_fail"], user(image_part(data_url(picture)), "What is it?"))
    grew = [
        e
        for e, b in zip(deployment["encoders"], before, strict=True)
        if metric_sum(e.metrics(), encoded) > b
    ]
    assert grew, "the picture was encoded by the pool"
    return grew


def test_a_hung_encoder_times_out_and_the_item_is_retried(deployment, reference) -> None:
    lm = deployment["lm"]
    hung = _encoders_that_encode(deployment, IMAGES["fault"])  # where `lm` will send it
    retries = "mmserve_remote_encoder_retries_total"
    before = read_metrics(lm.url)[retries]
    for enc in hung:
        enc.pause()
    try:
        messages = user(
            image_part(data_url(IMAGES["fault"])),
            image_part(data_url(IMAGES["fault2"])),
            "Compare them.",
        )
        start = time.monotonic()
        assert _ask(lm, messages) == _greedy(reference, messages)  # retried (or local)
        assert time.monotonic() - start < TIMEOUT_S * 4 + 10
    finally:
        for enc in hung:
            enc.resume()
    assert read_metrics(lm.url)[retries] > before


def test_a_killed_encoder_is_retried_elsewhere_then_fallen_back(deployment, reference) -> None:
    lm, lm_fail = deployment["lm"], deployment["lm_fail"]
    deployment["encoders"][0].kill()
    messages = user(image_part(data_url(png_bytes(56, 56, 21))), "What is in the image?")
    assert _ask(lm, messages) == _greedy(reference, messages)
    # The last encoder hangs too: `lm` encodes locally, `lm_fail` answers 503 in time.
    last = deployment["encoders"][1]
    last.pause()
    try:
        fallbacks = "mmserve_remote_encoder_fallbacks_total"
        before = read_metrics(lm.url)[fallbacks]
        messages = user(image_part(data_url(png_bytes(84, 84, 22))), "What is in the image?")
        assert _ask(lm, messages) == _greedy(reference, messages)
        assert read_metrics(lm.url)[fallbacks] == before + 1
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            _ask(lm_fail, user(image_part(data_url(png_bytes(56, 84, 23))), "And this?"))
        assert info.value.status_code == 503, info.value.response.text
        assert "encoder" in info.value.response.text
        assert time.monotonic() - start < TIMEOUT_S * 3 + 10
        assert httpx.get(f"{lm_fail.url}/health", timeout=5).status_code == 200
    finally:
        last.resume()
    # Text-only requests never needed the pool.
    assert _ask(lm_fail, user("hello")) is not None


# ------------------------------------------------------------ Qwen2.5-VL, through the offline API


def test_qwen2_5_vl_through_the_offline_api_equals_local(qwen2_5_vl_dir: Path, tmp_path) -> None:
    """The offline LLM takes the same flags: `encoder_urls` makes it a disaggregated engine."""
    enc = Encoder(qwen2_5_vl_dir, tmp_path / "enc.log").wait_ready()
    try:
        conversations = list(CONVERSATIONS.values())
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        with LLM(str(qwen2_5_vl_dir), max_num_batched_tokens=32) as local:
            want = [o.outputs[0].token_ids for o in local.chat(conversations, params)]
        with LLM(str(qwen2_5_vl_dir), max_num_batched_tokens=32, encoder_urls=[enc.url]) as remote:
            got = [o.outputs[0].token_ids for o in remote.chat(conversations, params)]
            stats = remote.engine.core.scheduler.make_stats()
            assert stats.encoder_inflight_items == 0 and stats.encoder_cache_used_bytes == 0
            assert stats.encoder_pool_bytes > 0  # the embeddings came from the pool
        assert got == want
        assert metric_sum(enc.metrics(), "mmserve_encoder_items_encoded_total") == 3
    finally:
        enc.stop()
