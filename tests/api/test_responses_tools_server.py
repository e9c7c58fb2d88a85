"""Function tools through /v1/responses on a real server (a tiny random checkpoint with a tool
chat template): a named or required tool_choice gives function_call items whose arguments
follow the tool's schema, the same calls chat completions give, and tool history goes back
through the template."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from tests.support.factory import write_tiny_checkpoint
from tests.support.harness import Server
from tests.support.tool_template import TOOL_CHAT_TEMPLATE

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["C", "F"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}
CHAT_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS},
}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out: Path = write_tiny_checkpoint(tmp_path_factory.mktemp("rt_ckpt"), "qwen2_vl", seed=11)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    log = tmp_path_factory.mktemp("rt_log") / "server.log"
    srv = Server(out, log, "--max-model-len", "2048")
    yield srv
    srv.stop()


def _model(server: Server) -> str:
    return server.client.models.list().data[0].id


@pytest.mark.parametrize("choice", ["named", "required"])
def test_tool_choice_gives_the_chat_calls_as_function_call_items(server, choice) -> None:
    named = choice == "named"
    response = server.client.responses.create(
        model=_model(server),
        input=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"} if named else "required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
    )
    chat = server.client.chat.completions.create(
        model=_model(server),
        messages=[{"role": "user", "content": ASK}],
        tools=[CHAT_WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}
        if named
        else "required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and len(calls) == len(response.output)  # only calls, no message item
    chat_calls = chat.choices[0].message.tool_calls or []
    assert [(c.name, c.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in chat_calls
    ]
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)


def test_tool_history_renders_like_chat(server) -> None:
    args = '{"city": "Paris", "unit": "C"}'
    response = server.client.responses.create(
        model=_model(server),
        input=[
            {"role": "user", "content": ASK},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": args,
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21"},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    chat = server.client.chat.completions.create(
        model=_model(server),
        messages=[
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": args},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
        ],
        tools=[CHAT_WEATHER],
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_a_streamed_call_is_the_whole_call(server) -> None:
    request = {
        "model": _model(server),
        "input": ASK,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 200,
        "temperature": 0,
    }
    whole = server.client.responses.create(**request)
    with server.client.responses.stream(**request) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()  # the call finished: response.completed
    (call,) = final.output
    (expected,) = whole.output
    assert call.type == expected.type == "function_call"
    assert "".join(deltas) == call.arguments == expected.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
