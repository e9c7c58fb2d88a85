"""JSON bodies with limits: depth, number length, finite numbers, valid Unicode, each a 400
whose param is the path of the value at fault; and fast on a big body of base64."""

from __future__ import annotations

import base64
import json
import os
import time

import pytest

from mmserve.api.errors import APIError
from mmserve.api.json_body import MAX_DEPTH, MAX_JSON_VALUES, MAX_NUMBER_CHARS, parse_json_body


def refusal(raw: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse_json_body(raw)
    assert info.value.status_code == 400
    # The answer must itself be sendable as UTF-8 JSON.
    json.dumps({"m": info.value.message, "p": info.value.param}, ensure_ascii=False).encode()
    return info.value


def nested(depth: int, inner: bytes = b"1") -> bytes:
    return b'{"a": ' + b"[" * (depth - 1) + inner + b"]" * (depth - 1) + b"}"


def test_depth_limit_and_a_50000_deep_body() -> None:
    assert parse_json_body(nested(MAX_DEPTH))
    err = refusal(nested(MAX_DEPTH + 1))
    assert f"{MAX_DEPTH} levels" in err.message and err.param.startswith("a.0.0")
    for body in (nested(50_000), b'{"a": ' + b'{"b": ' * 50_000 + b"1" + b"}" * 50_001):
        assert "nested" in refusal(body).message  # the C scanner's RecursionError, caught


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"seed": ' + b"9" * 5000 + b"}", "seed"),  # over Python's int-digits limit
        (b'{"seed": ' + b"9" * (MAX_NUMBER_CHARS + 1) + b"}", "seed"),
        (b'{"stop_token_ids": [1, -' + b"9" * 100 + b"]}", "stop_token_ids.1"),
        (b'{"temperature": 0.' + b"1" * 100 + b"}", "temperature"),
        (b'{"temperature": 1e400}', "temperature"),
        (b'{"temperature": NaN}', "temperature"),
        (b'{"top_p": Infinity}', "top_p"),
        (b'{"x": {"y": [-Infinity]}}', "x.y.0"),
        (b'{"messages": [{"content": "ok \\ud800"}]}', "messages.0.content"),
        (b'{"messages": [{"content": "\\udfff"}]}', "messages.0.content"),
    ],
)
def test_bad_values_are_refused_at_their_path(raw: bytes, param: str) -> None:
    err = refusal(raw)
    assert err.param == param and err.message.startswith(param)


def test_a_lone_surrogate_in_a_key_is_refused_and_not_echoed_raw() -> None:
    err = refusal(b'{"chat_template_kwargs": {"\\ud800": 1}}')
    assert err.param == "chat_template_kwargs.\\ud800"


def test_valid_unicode_and_long_but_legal_numbers_pass() -> None:
    body = parse_json_body(
        b'{"t": "\\ud83d\\ude00 caf\xc3\xa9", "n": -' + b"9" * MAX_NUMBER_CHARS + b', "f": 1e308}'
    )
    assert body["t"] == "\U0001f600 café" and body["n"] == -int("9" * MAX_NUMBER_CHARS)


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"\xff{}", "UTF-8"),
        (b'{"a": "\xed\xa0\x80"}', "UTF-8"),  # a surrogate encoded directly in UTF-8
        (b"[1, 2]", "JSON object"),
        (b'{"a": 1,}', "line 1, column 9"),
        (b"", "not valid JSON"),
    ],
)
def test_malformed_bodies(raw: bytes, fragment: str) -> None:
    assert fragment in refusal(raw).message


def test_a_60_mb_base64_body_parses_about_as_fast_as_plain_json() -> None:
    url = "data:image/png;base64," + base64.b64encode(os.urandom(45 << 20)).decode()
    raw = json.dumps({"messages": [{"content": [{"image_url": {"url": url}}]}]}).encode()
    start = time.perf_counter()
    json.loads(raw)
    plain_s = time.perf_counter() - start
    start = time.perf_counter()
    parse_json_body(raw)
    ours_s = time.perf_counter() - start
    assert ours_s < 2 * plain_s + 0.1, (ours_s, plain_s)


@pytest.mark.parametrize("unit", [b"[],", b"1.5,", b'"ab",', b'{"a":1},'])
def test_a_body_of_millions_of_small_values_is_refused_before_parsing(unit: bytes) -> None:
    # json.loads of 60 MB of `[],` took 1.4 GB and 14 s.
    raw = b'{"prompt": [' + unit * (MAX_JSON_VALUES + 1) + b"1]}"
    start = time.perf_counter()
    err = refusal(raw)
    assert "too many JSON values" in err.message
    assert time.perf_counter() - start < 1.0


def test_many_values_up_to_the_limit_still_parse() -> None:
    ids = list(range(MAX_JSON_VALUES - 100))
    raw = json.dumps({"prompt": ids, "stop": ["a:b,c[d"]}).encode()
    assert parse_json_body(raw)["prompt"] == ids
