"""Fixtures for the API tests: an echo engine, the app over it, and an in-process client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from mmserve.api.app import create_app
from tests.api.echo_engine import EchoEngine

MODEL = "echo-model"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine() -> EchoEngine:
    return EchoEngine()


def make_app(engine: EchoEngine, **kwargs: object) -> FastAPI:
    options: dict[str, object] = {
        "api_keys": None,
        "served_model_name": MODEL,
        "max_request_body_bytes": 1 << 20,
        "status_interval_s": None,
    }
    options.update(kwargs)
    return create_app(engine, **options)  # type: ignore[arg-type]


@pytest.fixture
async def client(engine: EchoEngine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=make_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def sse_payloads(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking every event is well-formed."""
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: ") :] for e in events]
