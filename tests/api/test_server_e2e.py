"""End to end: `python -m mmserve serve` on a tiny checkpoint, driven by openai and httpx."""

from __future__ import annotations

import asyncio
import signal
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.factory import png_bytes
from tests.support.harness import (
    Server,
    data_url,
    image_part,
    read_metrics,
    user,
    wait_until_idle,
)
from tests.support.media_server import MediaServer, running_media_server


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("allowed_media")


@pytest.fixture(scope="module")
def redirect_web() -> Iterator[MediaServer]:
    """A redirecting media server, started first so that its port can be allowlisted."""
    with running_media_server() as web:
        web.redirects["/redirect.png"] = f"http://localhost:{web.port}/target.png"
        yield web


@pytest.fixture(scope="module")
def server(
    qwen2_vl_dir: Path, media_dir: Path, redirect_web: MediaServer, tmp_path_factory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    srv = Server(
        qwen2_vl_dir,
        log,
        "--limit-mm-per-prompt", '{"image": 2}',
        "--allowed-local-media-path", str(media_dir),
        # 127.0.0.1 on the redirecting server's port is listed so that the redirect test
        # reaches it; its target is addressed as `localhost`, which is not listed.
        "--allowed-media-domains", f"127.0.0.1:{redirect_web.server_port}",
        "--media-fetch-timeout", "3",
    )  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model_name(server: Server) -> str:
    return server.client.models.list().data[0].id


def test_models_and_health(server: Server, qwen2_vl_dir: Path) -> None:
    # named by the --model string as given, as vLLM does
    assert [m.id for m in server.client.models.list().data] == [str(qwen2_vl_dir)]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_chat_with_image_equals_offline_greedy(server: Server, qwen2_vl_dir: Path, model_name):
    from mmserve import LLM, SamplingParams

    messages = user(image_part(data_url(png_bytes(56, 84, seed=1))), "What is in the image?")
    offline = LLM(model=str(qwen2_vl_dir)).chat(
        messages, SamplingParams(temperature=0, max_tokens=8)
    )[0]
    resp = server.client.chat.completions.create(
        model=model_name, messages=messages, temperature=0, max_tokens=8
    )
    assert resp.choices[0].message.content == offline.outputs[0].text
    assert resp.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert resp.usage.completion_tokens == len(offline.outputs[0].token_ids)

    stream = server.client.chat.completions.create(
        model=model_name,
        messages=messages,
        temperature=0,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == offline.outputs[0].text
    assert chunks[-1].usage.prompt_tokens == len(offline.prompt_token_ids)


def test_two_images_count_both(server: Server, model_name: str) -> None:
    one = user(image_part(data_url(png_bytes(56, 56, seed=2))), "Compare.")
    two = user(
        image_part(data_url(png_bytes(56, 56, seed=2))),
        image_part(data_url(png_bytes(56, 56, seed=3))),
        "Compare.",
    )
    kwargs = {"model": model_name, "temperature": 0, "max_tokens": 4}
    usage_one = server.client.chat.completions.create(messages=one, **kwargs).usage
    usage_two = server.client.chat.completions.create(messages=two, **kwargs).usage
    # A 56×56 image is 2×2 merged patches: 4 placeholders, plus the vision start/end markers.
    assert usage_two.prompt_tokens - usage_one.prompt_tokens == 4 + 2


def test_same_image_three_times_is_encoded_once(server: Server, model_name: str) -> None:
    messages = user(image_part(data_url(png_bytes(84, 56, seed=4))), "Describe.")
    before = read_metrics(server.url)
    for salt in ("a", "b", "c"):  # distinct salts: no KV prefix hits, so the encoder is asked
        server.client.chat.completions.create(
            model=model_name,
            messages=messages,
            max_tokens=2,
            temperature=0,
            extra_body={"cache_salt": salt},
        )
    after = read_metrics(server.url)
    encoded = 'mmserve_encoder_items_encoded_total{modality="image"}'
    hits = "mmserve_encoder_cache_hits_total"
    assert after[encoded] - before[encoded] == 1
    assert after[hits] - before[hits] == 2


def _bomb_png(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 4096)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_hostile_inputs_never_5xx_and_leave_nothing_behind(
    server: Server,
    model_name: str,
    media_dir: Path,
    tmp_path: Path,
    redirect_web: MediaServer,
) -> None:
    web = redirect_web
    outside = tmp_path / "outside.png"
    outside.write_bytes(png_bytes(28, 28))
    valid = png_bytes(56, 56, seed=5)
    special = "<|vision_start|><|image_pad|><|vision_end|>"
    cases = {
        "bad base64": user(image_part("data:image/png;base64,!!!not-base64!!!"), "x"),
        "non-image bytes": user(image_part(data_url(b"hello, not an image")), "x"),
        "truncated png": user(image_part(data_url(valid[: len(valid) // 2])), "x"),
        "decompression bomb": user(image_part(data_url(_bomb_png(60000, 60000))), "x"),
        "1x1 image": user(image_part(data_url(png_bytes(1, 1))), "x"),
        "28x5000 image": user(image_part(data_url(png_bytes(28, 5000))), "x"),
        "too many images": user(*[image_part(data_url(valid))] * 3, "x"),
        "typed vision tokens": user(special * 3, "x"),
        "typed vision tokens + image": user(image_part(data_url(valid)), special),
        "loopback url": user(image_part(f"http://localhost:{server.port}/metrics"), "x"),
        "loopback v6": user(image_part("http://[::1]/x.png"), "x"),
        "link-local url": user(image_part("http://169.254.169.254/latest/meta-data/"), "x"),
        "file outside allowed": user(image_part(outside.as_uri()), "x"),
        "file /etc/passwd": user(image_part("file:///etc/passwd"), "x"),
        "redirect to unlisted": user(
            image_part(f"http://127.0.0.1:{web.server_port}/redirect.png"), "x"
        ),
    }
    statuses = {}
    try:
        for name, messages in cases.items():
            body = {"model": model_name, "messages": messages, "max_tokens": 4}
            resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
            statuses[name] = resp.status_code
            if resp.status_code >= 400:
                assert set(resp.json()["error"]) >= {"message", "type", "code"}, name
        body = {
            "model": model_name,
            "messages": user(image_part(data_url(valid)), "x"),
            "mm_processor_kwargs": {"no_such_kwarg": 1},
            "max_tokens": 4,
        }
        statuses["unknown mm_processor_kwargs"] = httpx.post(
            f"{server.url}/v1/chat/completions", json=body, timeout=60
        ).status_code
    finally:
        web.shutdown()
    assert all(s < 500 for s in statuses.values()), statuses
    for name in ("bad base64", "non-image bytes", "decompression bomb", "too many images"):
        assert statuses[name] == 400, statuses
    for name in ("loopback url", "link-local url", "file outside allowed", "redirect to unlisted"):
        assert statuses[name] == 400, statuses
    assert "/redirect.png" in web.requests_seen  # the listed host:port was reached...
    assert "/target.png" not in web.requests_seen  # ...and its redirect target never fetched

    assert httpx.get(f"{server.url}/health").status_code == 200
    ok = server.client.chat.completions.create(
        model=model_name, messages=user(image_part(data_url(valid)), "x"), max_tokens=4
    )
    assert ok.choices[0].finish_reason in ("stop", "length")
    wait_until_idle(server.url)


def test_cancelled_streams_free_everything(server: Server, model_name: str) -> None:
    async def one(client: httpx.AsyncClient, seed: int) -> None:
        body = {
            "model": model_name,
            "messages": user(image_part(data_url(png_bytes(56, 56, seed=100 + seed))), "Go."),
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break  # leave midway: closing the response drops the connection

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(one(client, i) for i in range(16)))

    asyncio.run(main())
    wait_until_idle(server.url)


def test_sigterm_with_requests_in_flight_exits_zero(qwen2_vl_dir: Path, tmp_path: Path) -> None:
    srv = Server(qwen2_vl_dir, tmp_path / "sigterm.log")
    name = srv.client.models.list().data[0].id
    errors: list[BaseException] = []

    def in_flight() -> None:
        try:
            srv.client.chat.completions.create(
                model=name, messages=user("Count."), max_tokens=64, extra_body={"ignore_eos": True}
            )
        except BaseException as exc:  # the server may cut it after the grace period
            errors.append(exc)

    threads = [threading.Thread(target=in_flight) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    start = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    returncode = srv.proc.wait(timeout=30)
    assert time.monotonic() - start < 30
    for t in threads:
        t.join(timeout=10)
    srv.log.close()
    assert returncode == 0, srv.log_path.read_text()
