"""tools / tool_choice checks at the edge (over the echo engine): each mistake is a 400 naming
the field before anything is processed, and what the tools ask reaches the engine."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from mmserve.config.server import ServerConfig
from mmserve.structured_output.params import StructuredOutputParams
from tests.support.echo_app import assert_openai_error, chat, make_app
from tests.support.echo_engine import EchoEngine

pytestmark = pytest.mark.anyio
URL = "/v1/chat/completions"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture
def engine() -> EchoEngine:
    return EchoEngine(max_model_len=2048)  # the tools travel in the echoed prompt


@pytest.fixture
async def auto_client(engine: EchoEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(engine, enable_auto_tool_choice=True, tool_call_parser="hermes")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def _fn(**function: object) -> dict:
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": []}, "tools"),
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [_fn(parameters={})]}, "tools[0].function.name"),
        ({"tools": [_fn(name="")]}, "tools[0].function.name"),
        ({"tools": [_fn(name="f", parameters={"type": "array"})]}, "tools[0].function.parameters"),
        ({"tools": [_fn(name="f", parameters=[1])]}, "tools[0].function.parameters"),
        ({"tools": [_fn(name="f", description=3)]}, "tools[0].function.description"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [WEATHER], "tool_choice": "maybe"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function"),
        ({"tools": [WEATHER], "tool_choice": _fn(name="nope")}, "tool_choice.function.name"),
        ({"tools": [WEATHER], "tool_choice": _fn(name=7)}, "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": NAMED}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),  # no --enable-auto-...
        ({"tools": [WEATHER]}, "tool_choice"),  # auto is the default with tools
        (
            {"tools": [WEATHER], "tool_choice": "none", "parallel_tool_calls": 1},
            "parallel_tool_calls",
        ),  # noqa: E501
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },  # noqa: E501
            "tool_choice",
        ),
        (
            {
                "tools": [
                    _fn(
                        name="f",
                        parameters={"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    )
                ],  # noqa: E501
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
async def test_malformed_tools_are_400s_naming_the_field(client, engine, extra, param):
    resp = await client.post(URL, json=chat("hi", **extra))
    assert_openai_error(resp, 400, param)
    assert engine.namespaces == []  # refused before any processing


async def test_auto_needs_the_flag_and_is_accepted_with_it(auto_client, engine):
    resp = await auto_client.post(URL, json=chat("hi", tools=[WEATHER], max_tokens=2))
    assert resp.status_code == 200, resp.text
    # as vLLM: the auto parser sees special tokens (a tokenizer may mark <tool_call> special)
    assert engine.sampling_params[-1].skip_special_tokens is False


async def test_required_and_named_become_the_grammar(client, engine):
    resp = await client.post(URL, json=chat("hi", tools=[WEATHER], tool_choice=NAMED, max_tokens=2))
    assert resp.status_code == 200, resp.text
    params = WEATHER["function"]["parameters"]
    assert engine.sampling_params[-1].structured_outputs == StructuredOutputParams.json(params)
    resp = await client.post(
        URL,
        json=chat("hi", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                  max_tokens=2),
    )  # fmt: skip
    assert resp.status_code == 200, resp.text
    schema = json.loads(engine.sampling_params[-1].structured_outputs.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    item = schema["items"]["anyOf"][0]
    assert item["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert item["properties"]["parameters"] == params
    assert item["additionalProperties"] is False


async def test_none_passes_the_tools_to_the_template_and_parses_nothing(client, engine):
    resp = await client.post(
        URL, json=chat("hi", tools=[WEATHER], tool_choice="none", max_tokens=4)
    )
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"]
    assert engine.sampling_params[-1].structured_outputs is None


def test_flags_refuse_unknown_parsers_and_auto_without_a_parser():
    with pytest.raises(ValueError, match="tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool-call-parser"):
        ServerConfig(tool_call_parser="mistral")
    with pytest.raises(ValueError, match="reasoning-parser"):
        ServerConfig(reasoning_parser="deepseek_r1")


def test_reasoning_parser_needs_the_think_tokens():
    with pytest.raises(ValueError, match="<think>"):
        make_app(EchoEngine(), reasoning_parser="qwen3")


async def test_without_parsers_the_text_is_returned_as_is(client):
    text = '<think>a</think>b <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    resp = await client.post(URL, json=chat(text, max_tokens=len(text)))
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text}
    assert choice["finish_reason"] == "length"
    assert "completion_tokens_details" not in resp.json()["usage"]
