"""Function tools in /v1/responses over the echo engine: Responses' tool shapes become chat's,
the calls the chat parser reads come back as function_call items, and tool history items reach
the template as chat's tool_calls / tool messages."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.support.echo_app import MODEL, assert_openai_error, make_app
from tests.support.echo_engine import EchoEngine

pytestmark = pytest.mark.anyio
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture
def engine() -> EchoEngine:
    return EchoEngine(max_model_len=2048)  # the tools travel in the echoed prompt


@pytest.fixture
async def tools_client(engine: EchoEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(engine, enable_auto_tool_choice=True, tool_call_parser="hermes")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


async def test_a_named_tool_choice_returns_a_function_call_item(
    tools_client: httpx.AsyncClient, engine: EchoEngine
) -> None:
    body = {
        "model": MODEL,
        "input": "Paris?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 6,
    }
    resp = await tools_client.post("/v1/responses", json=body)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    (call,) = answer["output"]  # the echo's text is the call's arguments
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["call_id"].startswith("call_") and isinstance(call["arguments"], str)
    assert answer["tools"] == [WEATHER]
    spec = engine.sampling_params[-1].structured_outputs  # the grammar of its parameters
    assert spec is not None and spec.kind == "json_schema"


async def test_tool_history_items_reach_the_template(
    tools_client: httpx.AsyncClient, engine: EchoEngine
) -> None:
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    body = {
        "model": MODEL,
        "input": history,
        "tools": [WEATHER],
        "tool_choice": "none",
        "max_output_tokens": 300,
    }
    resp = await tools_client.post("/v1/responses", json=body)
    assert resp.status_code == 200, resp.text
    (message,) = resp.json()["output"]
    text = message["content"][0]["text"]
    # the echo renders the tools as a system turn, then each message's content
    assert '"name": "get_weather"' in text and "Weather in Paris?sunny" in text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{**WEATHER, "extra": 1}]}, "tools[0].extra"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, None),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "call_id": 1, "output": "x"}]}, None),
    ],
)
async def test_tool_mistakes_are_named(
    tools_client: httpx.AsyncClient, extra: dict, param: str | None
) -> None:
    resp = await tools_client.post("/v1/responses", json={"model": MODEL, "input": "x", **extra})
    error = assert_openai_error(resp, 400, param)
    if param is None:
        assert error["param"].startswith(("tool_choice", "input[0]")), error


async def test_auto_tool_choice_needs_the_server_flag(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "input": "x", "tools": [WEATHER]}
    error = assert_openai_error(await client.post("/v1/responses", json=body), 400)
    assert "--enable-auto-tool-choice" in error["message"]


async def test_a_streamed_call_adds_up_to_the_whole_one(tools_client: httpx.AsyncClient) -> None:
    body = {
        "model": MODEL,
        "input": "Paris?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 6,
    }
    whole = (await tools_client.post("/v1/responses", json=body)).json()["output"][0]
    resp = await tools_client.post("/v1/responses", json={**body, "stream": True})
    assert resp.status_code == 200, resp.text
    events = [
        json.loads(block.split("\n")[1].removeprefix("data: "))
        for block in filter(None, resp.text.split("\n\n"))
    ]
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2]["item"]["type"] == "function_call"
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    )
    (call,) = events[-1]["response"]["output"]
    assert deltas == call["arguments"] == whole["arguments"] == events[-3]["arguments"]
    assert call["name"] == "get_weather" and call["status"] == "completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
