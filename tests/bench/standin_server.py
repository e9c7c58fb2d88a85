"""A minimal OpenAI-style chat server for bench tests: streams SSE chunks with small sleeps."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


@dataclass
class StandInOptions:
    token_delay_s: float = 0.01
    send_usage: bool = True  # honour stream_options.include_usage
    fail_every: int = 0  # answer HTTP 503 to every n-th request (1-based), 0 = never
    truncate_request: int | None = None  # the n-th request's stream ends without [DONE]
    # Serve mmserve-style counters: an image URL seen before is an encoder-cache hit.
    with_metrics: bool = False
    received: list[dict] = field(default_factory=list)


def build_app(opts: StandInOptions) -> FastAPI:
    app = FastAPI()
    seen_urls: set[str] = set()
    counters = {"queries": 0, "hits": 0, "encoded": 0, "calls": 0}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "standin-model", "object": "model"}]}

    if opts.with_metrics:

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            lines = []
            for name, key in (
                ("mmserve_encoder_cache_queries", "queries"),
                ("mmserve_encoder_cache_hits", "hits"),
                ("mmserve_encoder_items_encoded", "encoded"),
                ("mmserve_encoder_forward_calls", "calls"),
            ):
                lines += [f"# TYPE {name} counter", f'{name}_total{{model="m"}} {counters[key]}']
            return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        opts.received.append(body)
        n = len(opts.received)
        if opts.fail_every and n % opts.fail_every == 0:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        urls = [
            part["image_url"]["url"]
            for m in body["messages"]
            if isinstance(m["content"], list)
            for part in m["content"]
            if part["type"] == "image_url"
        ]
        misses = [u for u in urls if u not in seen_urls]
        counters["queries"] += len(urls)
        counters["hits"] += len(urls) - len(misses)
        counters["encoded"] += len(misses)
        counters["calls"] += 1 if misses else 0
        seen_urls.update(urls)
        prompt_tokens = 16 * len(urls) + sum(
            len(str(m["content"]).split()) for m in body["messages"]
        )
        stream = _stream(body, prompt_tokens, opts, is_truncated=n == opts.truncate_request)
        return StreamingResponse(stream, media_type="text/event-stream")

    return app


async def _stream(body: dict, prompt_tokens: int, opts: StandInOptions, is_truncated: bool):
    def event(choices: list, **extra) -> str:
        chunk = {"id": "c", "object": "chat.completion.chunk", "model": body["model"]}
        return f"data: {json.dumps({**chunk, 'choices': choices, **extra})}\n\n"

    max_tokens = int(body["max_tokens"])
    yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}}])
    for i in range(max_tokens):
        await asyncio.sleep(opts.token_delay_s)
        finish = "length" if i == max_tokens - 1 else None
        yield event([{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": finish}])
        if is_truncated and i == 1:
            return
    if opts.send_usage and (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens}
        yield event([], usage=usage)
    yield "data: [DONE]\n\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_standin(opts: StandInOptions) -> Iterator[str]:
    """Runs the app on 127.0.0.1 in a thread; yields its base URL."""
    port = free_port()
    config = uvicorn.Config(build_app(opts), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "stand-in server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
