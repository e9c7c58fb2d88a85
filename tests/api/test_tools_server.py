"""Tool calling and reasoning through a real `mmserve serve` and the `openai` client.

The checkpoint is tiny and random, with `<think>`, `</think>`, `<tool_call>` and `</tool_call>`
as tokens of its vocabulary and a tool-calling chat template (tests/support/tool_template.py).
A random model never writes a tool call by itself, so the tests make it: a required or named
tool_choice through the grammar the server builds, and for the parsers a `guided_regex` that
spells an answer with reasoning and a hermes call (vLLM allows structured output beside
tool_choice auto), read back by the server's own parsers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import tokenizers

from tests.support.factory import png_bytes, write_tiny_checkpoint
from tests.support.harness import Server, data_url
from tests.support.tool_template import TOOL_CHAT_TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": 0, "maximum": 999},
                "y": {"type": "integer", "minimum": 0, "maximum": 999},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The answer the regex spells: reasoning, a little content, then one hermes call.
CALL_ARGS = {"city": "Paris", "unit": "C"}
ANSWER = (
    "<think>plan a call</think>ok "
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
    "</tool_call>"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = write_tiny_checkpoint(tmp_path_factory.mktemp("tools_ckpt"), "qwen2_vl", seed=11)
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens(TAGS)  # added tokens that are text, not special, as in Qwen's vocabulary
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def forced(checkpoint) -> dict:
    """The extra body that makes the model write ANSWER. The bias on the tag tokens makes it
    write each tag as its one token (as a trained model does) rather than spell it in bytes;
    the grammar masks them everywhere else."""
    tok = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    bias = {str(tok.token_to_id(t)): 100.0 for t in TAGS}
    return {"guided_regex": re.escape(ANSWER), "logit_bias": bias}


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("tools_log") / "server.log"
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    srv = Server(checkpoint, log, *flags, "--reasoning-parser", "qwen3", "--max-model-len", "2048")
    yield srv
    srv.stop()


def _create(server: Server, **kwargs):
    kwargs.setdefault("messages", ASK)
    return server.client.chat.completions.create(
        model=server.client.models.list().data[0].id, temperature=0, **kwargs
    )


def _collect(stream) -> tuple[dict, list[str], dict | None]:
    """A stream's reasoning, content, tool calls (by index), finish reasons, usage."""
    out = {"reasoning": "", "content": "", "calls": {}}
    finish, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            out["content"] += delta.content or ""
            for tc in delta.tool_calls or []:
                call = out["calls"].setdefault(tc.index, {"id": None, "name": None, "args": ""})
                if tc.id is not None:
                    assert call["id"] is None, "a call's id comes once"
                    call["id"], call["name"] = tc.id, tc.function.name
                    assert tc.type == "function"
                call["args"] += tc.function.arguments or ""
            if choice.finish_reason is not None:
                finish.append(choice.finish_reason)
    return out, finish, usage


def _check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# Bounded schemas (enums, maxLength, integer ranges, no extra properties) and one call at most,
# so that a random model's answer always ends within max_tokens.
def test_required_returns_calls_that_validate(server):
    reply = _create(
        server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        _check_call(call.function.name, call.function.arguments)
    streamed, finish, _ = _collect(
        _create(
            server,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            stream=True,
        )
    )
    assert finish == ["tool_calls"] and streamed["content"] == ""
    assert [c["name"] for c in streamed["calls"].values()] == [
        c.function.name for c in choice.message.tool_calls
    ]
    for call in streamed["calls"].values():
        _check_call(call["name"], call["args"])


@pytest.mark.parametrize("name", ["get_weather", "add"])
def test_named_function_returns_its_call(server, name):
    named = {"type": "function", "function": {"name": name}}
    reply = _create(server, tools=TOOLS, tool_choice=named, max_tokens=200)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI and vLLM: a named call ends in "stop"
    (call,) = choice.message.tool_calls
    assert call.function.name == name
    _check_call(name, call.function.arguments)
    streamed, finish, _ = _collect(
        _create(server, tools=TOOLS, tool_choice=named, max_tokens=200, stream=True)
    )
    assert finish == ["stop"] and list(streamed["calls"]) == [0]
    assert streamed["calls"][0]["args"] == call.function.arguments


def test_auto_reads_reasoning_and_a_hermes_call_out_of_the_answer(server, forced):
    regex = forced
    reply = _create(
        server, tools=TOOLS, max_tokens=300, extra_body=regex, logprobs=True, top_logprobs=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    message = choice.message
    assert message.reasoning_content == "plan a call"
    assert message.content == "ok "
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL_ARGS
    # reasoning tokens: those between the <think> and </think> tokens the model generated
    tokens = [t.token for t in choice.logprobs.content]
    expected = tokens.index("</think>") - tokens.index("<think>") - 1
    details = reply.usage.completion_tokens_details
    assert details.reasoning_tokens == expected > 0
    assert reply.usage.completion_tokens == len(tokens)

    streamed, finish, usage = _collect(
        _create(
            server,
            tools=TOOLS,
            max_tokens=300,
            extra_body=regex,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert finish == ["tool_calls"]
    assert (streamed["reasoning"], streamed["content"]) == ("plan a call", "ok ")
    assert [c["name"] for c in streamed["calls"].values()] == ["get_weather"]
    assert json.loads(streamed["calls"][0]["args"]) == CALL_ARGS
    assert usage.completion_tokens_details.reasoning_tokens == expected


def test_tool_choice_none_and_thinking_off_return_the_text_as_is(server, forced):
    regex = forced
    reply = _create(server, tools=TOOLS, tool_choice="none", max_tokens=300, extra_body=regex)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop"
    assert message.tool_calls is None
    assert message.reasoning_content == "plan a call"
    assert message.content == ANSWER[ANSWER.index("ok ") :]
    off = {**regex, "chat_template_kwargs": {"enable_thinking": False}}
    reply = _create(server, max_tokens=300, extra_body=off)
    assert reply.choices[0].message.content == ANSWER
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_tool_result_with_an_image_goes_back_through_the_template(server):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(CALL_ARGS)},
    }
    image = {"type": "image_url", "image_url": {"url": data_url(png_bytes(56, 56))}}

    def turn(parts):
        return [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": parts},
        ]

    text_only = _create(server, tools=TOOLS, messages=turn([{"type": "text", "text": "rain"}]),
                        max_tokens=2, tool_choice="none")  # fmt: skip
    with_image = _create(
        server,
        tools=TOOLS,
        messages=turn([{"type": "text", "text": "rain"}, image]),
        max_tokens=2,
        tool_choice="none",
    )
    # a 56x56 image is 2x2 merged patches: 4 placeholders plus vision start and end
    assert with_image.usage.prompt_tokens - text_only.usage.prompt_tokens == 6
    without_tools = _create(server, messages=turn([{"type": "text", "text": "rain"}]), max_tokens=2)
    assert without_tools.usage.prompt_tokens < text_only.usage.prompt_tokens  # tools rendered
