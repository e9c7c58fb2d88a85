"""Fixtures for the API tests: an echo engine, the app over it, and an in-process client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.support.echo_app import make_app
from tests.support.echo_engine import EchoEngine


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine() -> EchoEngine:
    return EchoEngine()


@pytest.fixture
async def client(engine: EchoEngine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=make_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c
