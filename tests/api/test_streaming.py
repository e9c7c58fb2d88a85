"""SSE answers, include_usage, in-band errors, and aborts when a client goes away (real uvicorn)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn

from tests.support.echo_app import MODEL, make_app, sse_payloads
from tests.support.echo_engine import FAIL_MARKER, FAIL_NOW_MARKER, EchoEngine

pytestmark = pytest.mark.anyio


def chat(content: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def test_chat_stream_matches_non_stream(client: httpx.AsyncClient) -> None:
    url = "/v1/chat/completions"
    whole = await client.post(url, json=chat("streaming!", max_tokens=7))
    resp = await client.post(url, json=chat("streaming!", max_tokens=7, stream=True))
    assert resp.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(resp.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole.json()["choices"][0]["message"]["content"] == "streami"
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all("usage" not in c for c in chunks)


async def test_include_usage_adds_a_final_usage_chunk(client: httpx.AsyncClient) -> None:
    body = chat("abc", max_tokens=4, stream=True, stream_options={"include_usage": True})
    payloads = sse_payloads((await client.post("/v1/chat/completions", json=body)).text)
    last = json.loads(payloads[-2])
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_completions_stream(client: httpx.AsyncClient) -> None:
    body = {"prompt": "xyz", "max_tokens": 5, "stream": True}
    payloads = sse_payloads((await client.post("/v1/completions", json=body)).text)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "xyzxy"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_engine_failure_mid_stream_is_an_error_event(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat(FAIL_MARKER, stream=True))
    assert resp.status_code == 200  # the failure comes after the stream has started
    payloads = sse_payloads(resp.text)
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["error"]["code"] == "request_failed"


async def test_stream_refusals_keep_their_status(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat(FAIL_NOW_MARKER, stream=True))
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "request_failed"
    resp = await client.post("/v1/chat/completions", json=chat("hi", stream=True, max_tokens=999))
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "max_tokens"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _serve(engine: EchoEngine) -> AsyncIterator[str]:
    port = _free_port()
    config = uvicorn.Config(
        make_app(engine), host="127.0.0.1", port=port, log_level="warning", lifespan="on"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def slow_server() -> AsyncIterator[tuple[str, EchoEngine]]:
    engine = EchoEngine(max_model_len=4096, token_delay_s=0.02)
    async for url in _serve(engine):
        yield url, engine
    assert engine.shutdown_calls == 1  # the lifespan shuts the engine down


async def _until(condition, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


async def test_streams_cancelled_midway_are_aborted(slow_server) -> None:
    url, engine = slow_server

    async def read_two_chunks_then_leave(c: httpx.AsyncClient) -> None:
        body = chat("a long answer", max_tokens=1000, stream=True)
        async with c.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            seen = 0
            while seen < 2:
                seen += (await anext(lines)).startswith("data: ")

    async with httpx.AsyncClient(timeout=10) as c:
        await asyncio.gather(*(read_two_chunks_then_leave(c) for _ in range(8)))
    await _until(lambda: len(engine.aborted) == 8 and not engine.running)
    metrics = engine.metrics.snapshot().gauges
    assert metrics["num_requests_running"] == 0
    assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"]


async def test_non_stream_request_is_aborted_when_client_leaves(slow_server) -> None:
    url, engine = slow_server
    async with httpx.AsyncClient(timeout=0.3) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post(f"{url}/v1/chat/completions", json=chat("wait", max_tokens=1000))
    await _until(lambda: len(engine.aborted) == 1 and not engine.running)
    assert not engine.finished
