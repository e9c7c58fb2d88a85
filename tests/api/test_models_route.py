"""GET /v1/models and the `model` field: every served name works, answers carry the first."""

from __future__ import annotations

import httpx
import pytest

from tests.support.echo_app import make_app
from tests.support.echo_engine import EchoEngine

pytestmark = pytest.mark.anyio


async def test_every_served_name_is_listed_and_accepted_answers_carry_the_first() -> None:
    app = make_app(EchoEngine(), served_model_name=["/models/qwen2-vl", "qwen"])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        listed = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == ["/models/qwen2-vl", "qwen"]
        assert {m["root"] for m in listed} == {"/models/qwen2-vl"}
        for name in ("/models/qwen2-vl", "qwen"):
            body = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
            r = await client.post("/v1/chat/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "/models/qwen2-vl"
        r = await client.post(
            "/v1/completions", json={"model": "other", "prompt": "hi", "max_tokens": 2}
        )
        assert r.status_code == 404
        assert "'/models/qwen2-vl', 'qwen'" in r.json()["error"]["message"]
