"""POST /tokenize and /detokenize over the echo engine: vLLM's shapes, the chat form counting
what a chat completion would, the options reaching the renderer, and the bounds."""

from __future__ import annotations

import httpx
import pytest

from mmserve.api.tokenize import MAX_DETOKENIZE_TOKENS
from tests.support.echo_app import MODEL, assert_openai_error, make_app
from tests.support.echo_engine import IMAGE_TOKEN_ID, IMAGE_TOKENS, EchoEngine
from tests.support.harness import data_url

pytestmark = pytest.mark.anyio
IMAGE = {"type": "image_url", "image_url": {"url": data_url(b"png")}}


async def test_a_prompt_is_tokenized(client: httpx.AsyncClient) -> None:
    resp = await client.post("/tokenize", json={"model": MODEL, "prompt": "hé"})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {
        "count": 3,
        "max_model_len": 64,
        "tokens": [104, 195, 169],
        "token_strs": None,
    }


async def test_messages_count_what_a_chat_completion_would(
    client: httpx.AsyncClient, engine: EchoEngine
) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "see"}, IMAGE]}]
    resp = await client.post(
        "/tokenize", json={"model": MODEL, "messages": messages, "return_token_strs": True}
    )
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    chat = await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1}
    )
    assert answer["count"] == chat.json()["usage"]["prompt_tokens"] == 3 + IMAGE_TOKENS
    assert answer["tokens"] == [*b"see", *[IMAGE_TOKEN_ID] * IMAGE_TOKENS]
    assert answer["token_strs"] == ["s", "e", "e", *["<image>"] * IMAGE_TOKENS]
    assert engine.chat_flags[0] == (True, False)  # vLLM's defaults reach the renderer


async def test_rendering_options_reach_the_renderer(
    client: httpx.AsyncClient, engine: EchoEngine
) -> None:
    body = {
        "messages": [{"role": "assistant", "content": "Once"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    resp = await client.post("/tokenize", json=body)
    assert resp.status_code == 200, resp.text
    assert engine.chat_flags == [(False, True)]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "unknown": 1}, "unknown"),
        ({"prompt": 5}, "prompt"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}, None),
        ({"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}, None),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]},
            "tools[0].type",
        ),
    ],
)
async def test_tokenize_refusals_name_the_field(
    client: httpx.AsyncClient, body: dict, param: str | None
) -> None:
    resp = await client.post("/tokenize", json=body)
    expected = param or next(k for k in body if k != "messages")
    assert_openai_error(resp, 400, expected)


async def test_detokenize_round_trips(client: httpx.AsyncClient) -> None:
    tokens = (await client.post("/tokenize", json={"prompt": "hé, there"})).json()["tokens"]
    resp = await client.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"prompt": "hé, there"}


@pytest.mark.parametrize(
    ("tokens", "param"),
    [
        ([1, -1], "tokens.1"),
        ([IMAGE_TOKEN_ID + 1], "tokens.0"),
        ([1, "2"], "tokens.1"),
        ([1, 2.0], "tokens.1"),
        ([0] * (MAX_DETOKENIZE_TOKENS + 1), "tokens"),
    ],
)
async def test_detokenize_refuses_what_is_not_a_token_id(
    client: httpx.AsyncClient, tokens: list, param: str
) -> None:
    resp = await client.post("/detokenize", json={"tokens": tokens})
    assert_openai_error(resp, 400, param)


async def test_a_model_the_server_does_not_serve_is_a_404(client: httpx.AsyncClient) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        resp = await client.post(path, json={**body, "model": "other"})
        assert_openai_error(resp, 404, "model")


async def test_api_key_guards_tokenize_and_detokenize(engine: EchoEngine) -> None:
    app = make_app(engine, api_keys=("s3cret",))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            assert_openai_error(await c.post(path, json=body), 401)
            auth = {"Authorization": "Bearer s3cret"}
            assert (await c.post(path, json=body, headers=auth)).status_code == 200


async def test_a_request_chat_template_needs_the_server_to_trust_it(engine: EchoEngine) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}
    app = make_app(engine, trust_request_chat_template=True)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        assert (await c.post("/tokenize", json=body)).status_code == 200


async def test_tools_reach_the_template_as_in_chat(client: httpx.AsyncClient) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "x"}]
    plain = (await client.post("/tokenize", json={"messages": messages})).json()
    with_tools = await client.post("/tokenize", json={"messages": messages, "tools": [tool]})
    assert with_tools.status_code == 200, with_tools.text
    assert with_tools.json()["count"] > plain["count"]  # the echo renders them as a system turn
