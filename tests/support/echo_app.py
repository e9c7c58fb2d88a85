"""The app over an echo engine, in process: how tests build it and read its replies."""

from __future__ import annotations

import httpx
from fastapi import FastAPI

from mmserve.api.app import create_app
from tests.support.echo_engine import EchoEngine

MODEL = "echo-model"


def make_app(engine: EchoEngine, **kwargs: object) -> FastAPI:
    options: dict[str, object] = {
        "api_keys": None,
        "served_model_name": MODEL,
        "max_request_body_bytes": 1 << 20,
        "status_interval_s": None,
    }
    options.update(kwargs)
    return create_app(engine, **options)  # type: ignore[arg-type]


def chat(content: object, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def sse_payloads(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking every event is well-formed."""
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: ") :] for e in events]
