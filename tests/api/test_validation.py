"""Validation at the edge, through the app: Content-Type, JSON limits, strict types, numeric
ranges and unsupported fields, each a 4xx that names the field, and nothing else changed."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from mmserve.api.unsupported import UNSUPPORTED_FIELDS
from tests.support.echo_app import MODEL, assert_openai_error, chat, make_app
from tests.support.echo_engine import EchoEngine

pytestmark = pytest.mark.anyio
CHAT_URL = "/v1/chat/completions"


async def post_raw(client: httpx.AsyncClient, raw: bytes, content_type: str | None = None):
    headers = {"content-type": content_type or "application/json"}
    return await client.post(CHAT_URL, content=raw, headers=headers)


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None,
     "application/json; charset=latin-1", "application/jsonx"],
)  # fmt: skip
async def test_only_json_bodies_are_accepted(
    client: httpx.AsyncClient, engine: EchoEngine, content_type: str | None
) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    raw = json.dumps(chat("hi")).encode()
    resp = await client.post(CHAT_URL, content=raw, headers=headers)
    error = assert_openai_error(resp, 415, "Content-Type")
    assert error["code"] == "unsupported_media_type"
    assert "application/json" in error["message"]
    assert engine.namespaces == []  # refused before the route ran


@pytest.mark.parametrize(
    "content_type", ["application/json", "Application/JSON", "application/json; charset=UTF-8"]
)
async def test_json_content_types_in_any_spelling_pass(
    client: httpx.AsyncClient, content_type: str
) -> None:
    resp = await post_raw(client, json.dumps(chat("hi")).encode(), content_type)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None),
        (b'{"messages": [], "seed": ' + b"1" * 5000 + b"}", "seed"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', "top_p"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e309}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages.0.content"),
    ],
)
async def test_hostile_json_is_a_400_naming_the_path(
    client: httpx.AsyncClient, raw: bytes, param: str | None
) -> None:
    error = assert_openai_error(await post_raw(client, raw), 400, param)
    assert error["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": 3, "min_tokens": 5}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": ["x" * 1025]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": "s" * 1025}, "cache_salt"),
        ({"min_p": 1.5}, "min_p"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),  # over --max-logprobs
        ({"logprobs": 1}, "logprobs"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"best_of": 0}, "best_of"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ],
)
async def test_out_of_range_numbers_are_400s_naming_the_field(
    client: httpx.AsyncClient, engine: EchoEngine, extra: dict, param: str
) -> None:
    resp = await client.post(CHAT_URL, json=chat("hi", **extra))
    assert_openai_error(resp, 400, param)
    assert engine.namespaces == []  # refused before the prompt was processed


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 5.0}, "max_tokens"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"ignore_eos": "true"}, "ignore_eos"),
        ({"seed": 1.5}, "seed"),
        ({"stream_options": {"include_usage": "on"}}, "stream_options.include_usage"),
    ],
)
async def test_values_pydantic_would_coerce_are_refused(
    client: httpx.AsyncClient, extra: dict, param: str
) -> None:
    assert_openai_error(await client.post(CHAT_URL, json=chat("hi", **extra)), 400, param)


async def test_edge_values_are_accepted_and_reach_the_engine_as_sent(
    client: httpx.AsyncClient, engine: EchoEngine
) -> None:
    extra = {
        "seed": 2**63 - 1, "top_k": -1, "top_p": 1, "stop": ["zz"] * 16,
        "stop_token_ids": [0, 2**31 - 1], "cache_salt": "s" * 1024, "max_tokens": 4,
    }  # fmt: skip
    resp = await client.post(CHAT_URL, json=chat("hi", **extra))
    assert resp.status_code == 200, resp.text
    params = engine.sampling_params[-1]
    assert (params.seed, params.top_k, params.max_tokens) == (2**63 - 1, -1, 4)
    for temperature, expected in ((0, 0.0), (1e-300, 0.01), (0.7, 0.7)):
        resp = await client.post(CHAT_URL, json=chat("hi", temperature=temperature))
        assert resp.status_code == 200, resp.text
        assert engine.sampling_params[-1].temperature == expected


# A value that matters, per unsupported field (each listed field must have one here).
MEANINGFUL = {
    "best_of": 2, "functions": [{"name": "f"}],
    "function_call": {"name": "f"},
    "audio": {"voice": "x"}, "modalities": ["text", "audio"], "echo": True, "suffix": "x",
    "stream_options.continuous_usage_stats": True,
    "length_penalty": 2.0, "use_beam_search": True,
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ",
    "structural_tag": "{}", "logits_processors": ["x"],
    "truncate_prompt_tokens": 5, "continue_final_message": True,
    "add_generation_prompt": False, "chat_template": "{{ messages }}", "documents": [{}],
    "return_tokens_as_token_ids": True, "prompt_embeds": "AAAA",
    "add_special_tokens": True, "spaces_between_special_tokens": False, "priority": 1,
    "vllm_xargs": {"k": 1},
}  # fmt: skip


def with_field(body: dict, dotted: str, value: object) -> dict:
    if "." in dotted:
        outer, inner = dotted.split(".")
        return {**body, outer: {inner: value}}
    return {**body, dotted: value}


def test_every_unsupported_field_has_a_meaningful_value_in_this_test() -> None:
    assert set(MEANINGFUL) == set(UNSUPPORTED_FIELDS)


# Listed fields that chat implements (and completions does not, as in vLLM).
CHAT_ONLY = {"add_generation_prompt", "continue_final_message"}


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_FIELDS))
async def test_unsupported_fields_with_a_value_that_matters_are_400s(
    client: httpx.AsyncClient, engine: EchoEngine, field: str
) -> None:
    if field in CHAT_ONLY:
        body = with_field({"prompt": "abc"}, field, MEANINGFUL[field])
        resp = await client.post("/v1/completions", json=body)
    else:
        resp = await client.post(CHAT_URL, json=with_field(chat("hi"), field, MEANINGFUL[field]))
    error = assert_openai_error(resp, 400, field)
    assert "not supported" in error["message"]
    assert engine.namespaces == []


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_FIELDS))
async def test_unsupported_fields_with_their_no_op_values_are_accepted(
    client: httpx.AsyncClient, field: str
) -> None:
    for value in (None, *UNSUPPORTED_FIELDS[field]):
        resp = await client.post(CHAT_URL, json=with_field(chat("hi"), field, value))
        assert resp.status_code == 200, (field, value, resp.text)


async def test_no_op_lookalikes_of_another_json_type_are_refused(
    client: httpx.AsyncClient,
) -> None:
    # In Python True == 1 and False == 0; in JSON they are different values.
    for field, value in (("best_of", True), ("echo", 0), ("priority", False)):
        resp = await client.post(CHAT_URL, json=chat("hi", **{field: value}))
        assert resp.status_code == 400, (field, value)


async def test_informational_fields_stay_ignored(client: httpx.AsyncClient) -> None:
    extra = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    resp = await client.post(CHAT_URL, json=chat("hi", max_tokens=2, **extra))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "hi"


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"logprobs": True}, "logprobs"), ({"logprobs": 21}, "logprobs"), ({"echo": 1}, "echo"),
     ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"min_p": 2}, "min_p"),
     ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
     ({"allowed_token_ids": []}, "allowed_token_ids"), ({"bad_words": [" "]}, "bad_words"),
     ({"suffix": "x"}, "suffix"), ({"max_tokens": 0}, "max_tokens"), ({"seed": 2**64}, "seed")],
)  # fmt: skip
async def test_completions_share_the_rules(
    client: httpx.AsyncClient, extra: dict, param: str
) -> None:
    resp = await client.post("/v1/completions", json={"prompt": "abc", **extra})
    assert_openai_error(resp, 400, param)


async def test_client_text_in_errors_is_cut_short(client: httpx.AsyncClient) -> None:
    resp = await client.post(CHAT_URL, json={**chat("hi"), "model": "m" * 100_000})
    assert len(assert_openai_error(resp, 404, "model")["message"]) < 400
    long_key = "k" * 100_000
    resp = await client.post(CHAT_URL, json=chat("hi", multi_modal_uuids={long_key: 5}))
    error = assert_openai_error(resp, 400)
    assert len(error["message"]) < 1000 and len(error["param"]) < 200


async def test_a_refusal_leaves_the_next_request_unchanged(engine: EchoEngine) -> None:
    app = make_app(engine, api_keys=("k",))
    headers = {"Authorization": "Bearer k"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.post(CHAT_URL, json=chat("hi", seed=2**64), headers=headers)).is_error
        resp = await c.post(CHAT_URL, json=chat("hello", max_tokens=5), headers=headers)
    assert resp.json()["choices"][0]["message"]["content"] == "hello"
    assert resp.json()["model"] == MODEL


async def _call_without_reading(app, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict]:
    """Call the ASGI app with a receive() that must never be awaited: the answer may not
    depend on a single byte of the body."""
    sent: list[dict] = []

    async def receive() -> dict:
        raise AssertionError("the body was read")

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": CHAT_URL, "raw_path": CHAT_URL.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"content-length", b"1000"), *headers],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
    }  # fmt: skip
    await app(scope, receive, send)
    start, body = sent[0], sent[1]
    assert (b"connection", b"close") in start["headers"]  # unread bytes: do not reuse
    return start["status"], json.loads(body["body"])


async def test_auth_then_content_type_are_decided_before_the_body(engine: EchoEngine) -> None:
    app = make_app(engine, api_keys=("k",))
    json_type = (b"content-type", b"application/json")
    status, body = await _call_without_reading(app, [json_type])
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _ = await _call_without_reading(app, [(b"authorization", b"Bearer x"), json_type])
    assert status == 401
    # Without a key, a wrong Content-Type is still a 401: nothing is said to strangers.
    status, _ = await _call_without_reading(app, [(b"content-type", b"text/plain")])
    assert status == 401
    good = (b"authorization", b"Bearer k")
    status, body = await _call_without_reading(app, [good, (b"content-type", b"text/plain")])
    assert status == 415 and body["error"]["param"] == "Content-Type"
    status, body = await _call_without_reading(
        make_app(engine, max_request_body_bytes=999), [good, json_type]
    )
    assert status == 413


async def test_a_body_slower_than_its_deadline_is_408(engine: EchoEngine) -> None:
    app = make_app(engine, http_body_timeout_s=0.3)

    async def trickle():  # a byte every 0.1 s: each chunk is "in time", the whole is not
        for _ in range(20):
            await asyncio.sleep(0.1)
            yield b" "

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        resp = await c.post(
            CHAT_URL, content=trickle(), headers={"content-type": "application/json"}
        )
        error = assert_openai_error(resp, 408)
        assert error["code"] == "request_timeout"
        assert (await c.post(CHAT_URL, json=chat("ok"))).status_code == 200


async def test_with_keys_every_path_but_the_probes_needs_one(engine: EchoEngine) -> None:
    app = make_app(engine, api_keys=("k",))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for path in ("/v1/models", "//v1/models", "/v1/models/", "/v1/nothing", "/", "/docs"):
            assert_openai_error(await c.get(path), 401)
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200
        good = {"Authorization": "Bearer k"}
        assert_openai_error(await c.get("/v1/nothing", headers=good), 404)
        assert (await c.get("/v1/models", headers={"Authorization": "bearer k"})).is_success


async def test_pydantic_messages_that_quote_the_input_are_cut_short(
    client: httpx.AsyncClient,
) -> None:
    resp = await client.post(CHAT_URL, json=chat([{"type": "v" * 100_000}]))
    error = assert_openai_error(resp, 400, "messages.0.content.0")
    assert len(error["message"]) < 1000
