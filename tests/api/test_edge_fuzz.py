"""Random types and values for every request field, through the app: never a 5xx, always an
OpenAI-style error naming a field, and an innocent request afterwards answered unchanged."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from mmserve.api.protocol import ChatCompletionRequest, CompletionRequest
from mmserve.api.unsupported import UNSUPPORTED_FIELDS
from tests.support.echo_app import chat

pytestmark = pytest.mark.anyio
NUM_REQUESTS = 300

FIELDS = sorted(
    set(ChatCompletionRequest.model_fields)
    | set(CompletionRequest.model_fields)
    | {f.split(".")[0] for f in UNSUPPORTED_FIELDS}
)


def random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(12 if depth < 3 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 2, 16, 2**31, 2**63, 2**64, -(2**63) - 1, 10**60])
    if kind == 3:
        return rng.choice([0.0, 1e-300, -0.5, 0.5, 1.5, 1e308, -1e308, 5e-324])
    if kind == 4:
        return rng.choice(["", "a", "x" * 2000, "\u0000", "\U0001f600", "none", "auto", "text"])
    if kind in (5, 6, 7, 8):  # raw JSON text the encoder would not write
        return rng.choice(["NaN", "Infinity", "-Infinity", "1" * 80, '"\\ud800"', "1e999"])
    if kind in (9, 10):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["type", "url", "k", ""]): random_value(rng, depth + 1) for _ in range(2)}


def encode(value: object) -> str:
    """JSON text; strings chosen from the raw list above are spliced in as they are."""
    if isinstance(value, str) and value in (
        "NaN", "Infinity", "-Infinity", "1" * 80, '"\\ud800"', "1e999",
    ):  # fmt: skip
        return value
    if isinstance(value, list):
        return "[" + ", ".join(encode(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {encode(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


async def test_random_fields_never_cause_a_5xx(client: httpx.AsyncClient) -> None:
    rng = random.Random(20)
    statuses: dict[int, int] = {}
    for _ in range(NUM_REQUESTS):
        base = chat("hi", max_tokens=2) if rng.random() < 0.7 else {"prompt": "hi"}
        url = "/v1/chat/completions" if "messages" in base else "/v1/completions"
        fields = {k: encode(v) for k, v in base.items()}
        for name in rng.sample(FIELDS, rng.randrange(1, 4)):
            fields[name] = encode(random_value(rng))
        raw = "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in fields.items()) + "}"
        resp = await client.post(
            url, content=raw.encode(), headers={"content-type": "application/json"}
        )
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        assert resp.status_code < 500, (raw[:500], resp.text[:500])
        if resp.status_code != 200:
            error = resp.json()["error"]
            assert error["message"]
            assert error["type"] in ("invalid_request_error", "not_found_error")
    assert statuses.get(400, 0) > NUM_REQUESTS // 2  # the fuzz did reach the checks
    resp = await client.post("/v1/chat/completions", json=chat("hello", max_tokens=5))
    assert resp.json()["choices"][0]["message"]["content"] == "hello"
