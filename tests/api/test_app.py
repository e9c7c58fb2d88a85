"""The HTTP app over a real (echo) engine: routes, auth, errors, limits, usage, metrics."""

from __future__ import annotations

import httpx
import pytest

from tests.support.echo_app import MODEL, assert_openai_error, chat, make_app
from tests.support.echo_engine import CRASH_MARKER, FAIL_MARKER, IMAGE_TOKENS, EchoEngine
from tests.support.harness import parse_samples

pytestmark = pytest.mark.anyio
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


async def test_models_and_health(client: httpx.AsyncClient, engine: EchoEngine) -> None:
    models = (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert (await client.get("/health")).status_code == 200
    engine.healthy = False
    assert (await client.get("/health")).status_code == 503
    assert_openai_error(await client.get("/v1/nothing-here"), 404)


async def test_chat_non_stream_text_and_exact_usage(client: httpx.AsyncClient) -> None:
    content = [{"type": "text", "text": "hello world"}, IMAGE, IMAGE]
    resp = await client.post("/v1/chat/completions", json=chat(content, max_tokens=5))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert body["choices"][0]["finish_reason"] == "length"
    prompt_tokens = len("hello world") + 2 * IMAGE_TOKENS
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == prompt_tokens + 5


async def test_stop_string_finishes_with_stop(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat("abcdef", stop=["cd"]))
    assert resp.json()["choices"][0]["finish_reason"] == "stop"


async def test_max_tokens_bounded_by_model_length(client: httpx.AsyncClient) -> None:
    # max_model_len 64, prompt 10 tokens: 54 tokens of room.
    resp = await client.post("/v1/chat/completions", json=chat("0123456789", max_tokens=55))
    error = assert_openai_error(resp, 400, "max_tokens")
    assert "54" in error["message"] and "64" in error["message"]
    resp = await client.post("/v1/chat/completions", json=chat("0123456789"))
    assert resp.json()["usage"]["completion_tokens"] == 54
    resp = await client.post(
        "/v1/chat/completions", json=chat("0123456789", max_completion_tokens=3)
    )
    assert resp.json()["usage"]["completion_tokens"] == 3
    assert_openai_error(await client.post("/v1/chat/completions", json=chat("x" * 64)), 400)


async def test_completions_with_text_and_token_ids(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})
    body = resp.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "abca"
    resp = await client.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 2})
    assert resp.json()["choices"][0]["text"] == "hi"
    assert resp.json()["usage"]["prompt_tokens"] == 2
    resp = await client.post("/v1/completions", json={"prompt": ["a", "b"]})
    assert_openai_error(resp, 400, "prompt")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "messages"),
        (chat("hi", temperature="hot"), "temperature"),
        (chat("hi", n=129), "n"),
        (chat("hi", top_p=0), "top_p"),
        (chat("hi", min_tokens=5, max_tokens=2), "min_tokens"),
        (chat([{"type": "video", "video": "x"}]), None),
        (chat([{"type": "image_url", "image_url": {"url": "ftp://x"}}]), "messages"),
        (chat("hi", mm_processor_kwargs={"max_pixelz": 1}), "mm_processor_kwargs"),
        (chat("hi", logprobs=2), "logprobs"),
    ],
)
async def test_user_mistakes_are_openai_400s(
    client: httpx.AsyncClient, body: dict, param: str | None
) -> None:
    error = assert_openai_error(await client.post("/v1/chat/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"


async def test_malformed_json_and_unknown_model(client: httpx.AsyncClient) -> None:
    resp = await client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert assert_openai_error(resp, 400)["code"] == "invalid_json"
    resp = await client.post("/v1/chat/completions", json={**chat("hi"), "model": "gpt-9"})
    assert assert_openai_error(resp, 404, "model")["code"] == "model_not_found"


async def test_engine_failure_of_one_request_is_400_not_500(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat(FAIL_MARKER))
    error = assert_openai_error(resp, 400)
    assert error["code"] == "request_failed"
    assert "embeddings" in error["message"]
    assert (await client.post("/v1/chat/completions", json=chat("ok"))).status_code == 200


async def test_api_key_guards_v1_only(engine: EchoEngine) -> None:
    app = make_app(engine, api_keys=("s3cret", "other-tenant"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert_openai_error(await c.get("/v1/models"), 401)
        wrong = {"Authorization": "Bearer nope"}
        resp = await c.post("/v1/chat/completions", json=chat("hi"), headers=wrong)
        assert assert_openai_error(resp, 401)["code"] == "invalid_api_key"
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200
        good = {"Authorization": "Bearer s3cret"}
        assert (await c.get("/v1/models", headers=good)).status_code == 200
        resp = await c.post("/v1/chat/completions", json=chat("hi"), headers=good)
        assert resp.status_code == 200
        other = {"Authorization": "Bearer other-tenant"}
        resp = await c.post("/v1/chat/completions", json=chat("hi"), headers=other)
        assert resp.status_code == 200
    # Each key is its own UUID namespace, derived from the key without revealing it.
    first, second = engine.namespaces[-2:]
    assert first != second
    assert first not in ("default", "s3cret") and "s3cret" not in first


async def test_namespace_is_default_without_api_key(client: httpx.AsyncClient, engine) -> None:
    await client.post("/v1/chat/completions", json=chat("hi"))
    assert engine.namespaces == ["default"]


async def test_body_size_cap_is_413(engine: EchoEngine) -> None:
    app = make_app(engine, max_request_body_bytes=1000)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        big = chat("x" * 2000)
        error = assert_openai_error(await c.post("/v1/chat/completions", json=big), 413)
        assert "1000" in error["message"]

        async def chunked():  # no Content-Length: the cap must count streamed bytes
            for _ in range(20):
                yield b" " * 100

        json_type = {"content-type": "application/json"}
        resp = await c.post("/v1/chat/completions", content=chunked(), headers=json_type)
        assert_openai_error(resp, 413)
        assert (await c.post("/v1/chat/completions", json=chat("small"))).status_code == 200


async def test_metrics_exports_engine_counters(client: httpx.AsyncClient) -> None:
    await client.post("/v1/chat/completions", json=chat("abc", max_tokens=3))
    resp = await client.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    samples = parse_samples(resp.text, model_name=MODEL)
    for name in (
        'mmserve_encoder_items_encoded_total{modality="image"}',
        "mmserve_prefix_cache_hits_total",
        "mmserve_encoder_cache_used_slots",
        "mmserve_num_requests_waiting",
        'mmserve_inter_token_latency_seconds_bucket{le="+Inf"}',
    ):
        assert name in samples, name
    assert samples["mmserve_generation_tokens_total"] == 3
    assert samples["mmserve_prompt_tokens_total"] == 3
    assert samples["mmserve_kv_blocks_free"] == samples["mmserve_kv_blocks_total"] == 16
    assert samples['mmserve_time_to_first_token_seconds_bucket{le="+Inf"}'] == 1
    assert samples["mmserve_time_to_first_token_seconds_count"] == 1


async def test_engine_bug_is_a_generic_500_that_leaks_nothing(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    resp = await client.post("/v1/chat/completions", json=chat(CRASH_MARKER))
    error = assert_openai_error(resp, 500)
    assert "secret" not in error["message"]
    assert "/srv/secret/path" in caplog.text  # the operator gets the traceback
    assert (await client.post("/v1/chat/completions", json=chat("ok"))).status_code == 200


async def test_union_field_errors_name_the_deepest_problem(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat([{"type": "video"}]))
    error = assert_openai_error(resp, 400, "messages.0.content.0")
    assert "valid string" not in error["message"] and "video" in error["message"]
