"""Property-style fuzzing of every request field against a real server: never a 5xx, never dead.

Each request starts from a valid one and replaces one to three fields (top-level or nested in
the messages) with values of random types drawn from an edge-case pool, and a few are mangled
as JSON text (NaN, lone surrogates, huge numbers). Whatever comes back must be a 2xx or a 4xx;
the server must stay healthy, and afterwards an innocent request gets its usual answer and
every KV block and encoder slot is free again.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from mmserve.config.model import bundled_toy_model_dir
from tests.api.hostile import chat_body, example, healthy, png_data_url
from tests.support.harness import Server, wait_until_idle

NUM_REQUESTS = 320
CONCURRENCY = 8
SEED = 20261201

CHAT_FIELDS = [
    "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n",
    "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
    "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "cache_salt", "logprobs",
    "top_logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p",
    "logit_bias", "best_of", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "mm_processor_kwargs", "multi_modal_uuids", "chat_template_kwargs", "user", "echo",
]  # fmt: skip
COMPLETION_FIELDS = [
    "prompt", "echo", "suffix", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
    "stream", "logprobs", "n", "min_tokens", "ignore_eos", "cache_salt", "best_of",
]  # fmt: skip
# Paths inside a chat body: (message index, key) or (message index, part index, key[, key]).
NESTED = [
    ("messages", 0, "role"),
    ("messages", 0, "content"),
    ("messages", 0, "content", 0),
    ("messages", 0, "content", 0, "type"),
    ("messages", 0, "content", 0, "image_url"),
    ("messages", 0, "content", 0, "image_url", "url"),
    ("messages", 0, "content", 0, "image_url", "uuid"),
    ("messages", 0, "content", 0, "image_url", "detail"),
    ("messages", 0, "content", 1, "text"),
    ("messages", 0, "content", 1, "type"),
]

INTS = [0, 1, -1, 2, 7, 255, 4096, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
FLOATS = [0.0, -0.0, 1e-300, 5e-324, 1e308, 0.5, 1.5, -2.5, 3.0, 0.009]
STRINGS = [
    "", "x", "red", "a" * 5000, "\u0000", "<|image_pad|>", "<|vision_start|>", "\u202e\ufeff",
    "data:image/png;base64,AAAA", "data:image/png;base64,!!!", "data:text/plain;base64,aGk=",
    "http://127.0.0.1:1/x.png", "http://169.254.169.254/latest", "file:///etc/passwd",
    "ftp://example.com/x", "mmserve-toy", "system", "user", "image_url", "text", "auto",
]  # fmt: skip


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.choice(["none", "bool", "int", "float", "str", "list", "dict"])
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice(INTS)
    if kind == "float":
        return rng.choice(FLOATS)
    if kind == "str":
        return rng.choice(STRINGS)
    if depth >= 2:
        return []
    if kind == "list":
        if rng.random() < 0.1:
            return list(range(300))
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["type", "url", "image", "text", "a", "max_pixels", "min_pixels", "include_usage"]
    return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _set(body: dict, path: tuple, value: Any) -> None:
    node: Any = body
    for key in path[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return  # an earlier mutation already replaced this branch
    with contextlib.suppress(IndexError, TypeError):
        node[path[-1]] = value


def _mangle(text: str, rng: random.Random) -> str:
    """JSON-text-only edge cases: literals Python's json accepts but JSON does not, and worse."""
    choice = rng.choice(["nan", "inf", "surrogate", "bignum", "deep", "truncate", "nul"])
    if choice == "nan":
        return text.replace('"temperature": 0', '"temperature": NaN')
    if choice == "inf":
        return text.replace('"max_tokens": 4', '"max_tokens": Infinity')
    if choice == "surrogate":
        return text.replace('"What', '"\\udc80What')
    if choice == "bignum":
        return text.replace('"max_tokens": 4', '"max_tokens": 4' + "0" * 4400)
    if choice == "deep":
        return text[:-1] + ', "user": ' + "[" * 5000 + "]" * 5000 + "}"
    if choice == "truncate":
        return text[: rng.randint(1, len(text) - 1)]
    return text.replace('"What', '"\\u0000What')


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    srv = Server(bundled_toy_model_dir(), tmp_path_factory.mktemp("fuzz") / "server.log")
    yield srv
    srv.stop()


def _requests(rng: random.Random) -> Iterator[tuple[str, str]]:
    image = png_data_url(example("red_circle"))
    for _ in range(NUM_REQUESTS):
        if rng.random() < 0.8:
            path, body = "/v1/chat/completions", chat_body(image, max_tokens=4)
            fields: list[Any] = [(f,) for f in CHAT_FIELDS] + NESTED
        else:
            path = "/v1/completions"
            body = {"model": "mmserve-toy", "prompt": "a red", "max_tokens": 4}
            fields = [(f,) for f in COMPLETION_FIELDS]
        for field in rng.sample(fields, rng.randint(1, 3)):
            _set(body, field, _value(rng))
        text = json.dumps(body)
        if rng.random() < 0.15:
            text = _mangle(text, rng)
        yield path, text


def _send(server: Server, path: str, text: str) -> tuple[int, str]:
    resp = httpx.post(
        server.url + path,
        content=text.encode("utf-8", "surrogatepass"),
        headers={"content-type": "application/json"},
        timeout=120,
    )
    return resp.status_code, resp.text


def test_no_field_value_gives_a_5xx_or_kills_the_engine(server):
    rng = random.Random(SEED)
    cases = list(_requests(rng))
    statuses: dict[int, int] = {}
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for start in range(0, len(cases), CONCURRENCY):
            batch = cases[start : start + CONCURRENCY]
            results = list(pool.map(lambda c: _send(server, *c), batch))
            for (path, text), (status, answer) in zip(batch, results, strict=True):
                statuses[status] = statuses.get(status, 0) + 1
                assert status < 500, f"{path} {text[:300]!r} -> {status} {answer[:300]}"
                # a streamed answer reports late failures in-band: never as a server error
                assert '"type": "server_error"' not in answer, (text[:300], answer[:300])
            assert healthy(server), f"unhealthy after batch at {start}"
    assert statuses.get(200, 0) >= 20, statuses  # the fuzzer also exercised real generation
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) >= 100, statuses
    reply = httpx.post(
        server.url + "/v1/chat/completions",
        json=chat_body(png_data_url(example("red_circle"))),
        timeout=60,
    ).json()
    assert reply["choices"][0]["message"]["content"].strip() == "a red circle"
    wait_until_idle(server.url, timeout_s=60)
