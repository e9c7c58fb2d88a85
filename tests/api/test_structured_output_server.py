"""Structured output through a real server and the `openai` client: response_format,
vLLM's structured_outputs and guided_* fields, streaming, and the 400s."""

from __future__ import annotations

import io
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

from mmserve import LLM, SamplingParams
from mmserve.config.model import bundled_toy_model_dir
from mmserve.structured_output.params import StructuredOutputParams
from tests.support.factory import write_tiny_checkpoint
from tests.support.grammar import SCHEMA
from tests.support.harness import Server, data_url
from tests.support.toy_examples import held_out

RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
}


def _png(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return data_url(buf.getvalue())


def _messages(num: int) -> list[list[dict]]:
    questions = held_out("shape", num)
    return [q.messages([{"type": "image_url", "image_url": {"url": _png(q.images[0])}}])
            for q in questions]  # fmt: skip


@pytest.fixture(scope="module")
def toy_server(tmp_path_factory):
    srv = Server(bundled_toy_model_dir(), tmp_path_factory.mktemp("so_toy") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("so_random"), "qwen2_vl", seed=7)


@pytest.fixture(scope="module")
def random_server(random_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("so_random_log") / "server.log"
    srv = Server(random_checkpoint, log, "--max-model-len", "1024")
    yield srv
    srv.stop()


def _chat(server: Server, messages, **extra):
    return server.client.chat.completions.create(
        model=server.client.models.list().data[0].id,
        messages=messages,
        max_tokens=48,
        temperature=0,
        **extra,
    )


@pytest.mark.parametrize("which", ["toy_server", "random_server"])
def test_json_schema_answers_validate_on_20_prompts(which, request):
    server = request.getfixturevalue(which)
    with ThreadPoolExecutor(4) as pool:
        replies = list(
            pool.map(lambda m: _chat(server, m, response_format=RESPONSE_FORMAT), _messages(20))
        )
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_the_server_answers_as_the_offline_engine_does(random_server, random_checkpoint):
    """The server runs its engine core in its own process; the offline LLM here in-process."""
    messages = [[{"role": "user", "content": f"question {i}"}] for i in range(3)]
    served = [_chat(random_server, m, response_format=RESPONSE_FORMAT) for m in messages]
    llm = LLM(model=str(random_checkpoint), max_model_len=1024)
    params = SamplingParams(
        temperature=0, max_tokens=48, structured_outputs=StructuredOutputParams.json(SCHEMA)
    )
    offline = llm.chat(messages, params)
    llm.shutdown()
    assert [r.choices[0].message.content for r in served] == [o.outputs[0].text for o in offline]


def test_json_object(toy_server):
    reply = _chat(toy_server, _messages(1)[0], response_format={"type": "json_object"})
    choice = reply.choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # cut at max_tokens, as in vLLM
        assert choice.finish_reason == "length"
        assert reply.usage.completion_tokens == 48


def test_vllm_fields_on_chat_and_completions(toy_server):
    messages = _messages(1)[0]
    choices = ["circle", "square"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        reply = _chat(toy_server, messages, extra_body=extra)
        assert reply.choices[0].message.content in choices
        assert reply.choices[0].finish_reason == "stop"
    reply = _chat(toy_server, messages, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    model = toy_server.client.models.list().data[0].id
    for extra in (
        {"guided_regex": "[0-9]{3}"},
        {"structured_outputs": {"regex": "[0-9]{3}"}},
        {"structured_outputs": {"grammar": "root ::= [0-9] [0-9] [0-9]"}},
        {"guided_grammar": "start: /[0-9]{3}/"},
    ):
        done = toy_server.client.completions.create(
            model=model, prompt="The number is", max_tokens=10, temperature=0, extra_body=extra
        )
        assert re.fullmatch("[0-9]{3}", done.choices[0].text), (extra, done.choices[0].text)
        assert done.choices[0].finish_reason == "stop"


def test_streaming_gives_the_same_structured_answer(toy_server):
    messages = _messages(1)[0]
    whole = _chat(toy_server, messages, response_format=RESPONSE_FORMAT).choices[0]
    stream = _chat(toy_server, messages, response_format=RESPONSE_FORMAT, stream=True)
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == whole.message.content
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
            "response_format.json_schema.schema",
            "invalid JSON schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "required",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        ({"guided_regex": "a(b"}, "guided_regex", "invalid regex"),
        ({"guided_grammar": "start: nothing"}, "guided_grammar", "invalid grammar"),
        ({"guided_choice": []}, "guided_choice", "list of 1 to"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "valid JSON"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"structured_outputs": {"whitespace_pattern": " "}},
         "structured_outputs.whitespace_pattern", "not supported"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "only one",
        ),
    ],
)  # fmt: skip
def test_bad_structured_output_requests_are_400s_naming_the_field(toy_server, extra, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(toy_server, [{"role": "user", "content": "hi"}], extra_body=extra)
    error = info.value.body
    assert error["param"] == param, error
    assert words in error["message"], error
    # the server goes on answering
    reply = _chat(
        toy_server, [{"role": "user", "content": "hi"}], extra_body={"guided_choice": ["a"]}
    )
    assert reply.choices[0].message.content == "a"
