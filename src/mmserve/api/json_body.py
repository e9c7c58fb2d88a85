"""Request bodies parsed as JSON with limits: nesting depth, number length, finite numbers,
valid Unicode. Each refusal is a 400 whose `param` is the path of the offending value."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Iterator
from typing import Any

from starlette.requests import Request

from mmserve.api.errors import APIError, dotted_path

MAX_DEPTH = 64
# Longer numbers are never a real sampling value or token id; int() of thousands of digits
# also raises (Python's int-digits limit) and takes quadratic time.
MAX_NUMBER_CHARS = 64
# Integers are parsed by the C scanner (a Python hook per integer costs 0.3 s per million);
# the walk then refuses any of more than MAX_NUMBER_CHARS digits.
_INT_LIMIT = 10**MAX_NUMBER_CHARS
# A lone surrogate can only come from a \uD800-\uDFFF escape: the body itself is strict UTF-8.
# Without such an escape in the text, no string needs checking (the common, fast case).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
# Python spends 30-80 bytes per JSON value (json.loads of a 60 MB body of `[],` took 1.4 GB and
# 14 s here), so a body may hold at most this many values, counted before parsing.
MAX_JSON_VALUES = 1 << 20
# Bodies over this are parsed in a worker thread. json.loads itself holds the GIL, but the
# checking walk after it does not, so the event loop streams tokens to others meanwhile
# (measured on 1M token ids: the loop's longest stall 0.42 s inline, 0.21-0.38 s threaded).
_PARSE_IN_THREAD_BYTES = 1 << 20


class _BadValue:
    """Stands in for a JSON value the hooks refused, so the walk can report where it was."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


async def read_json_body(request: Request) -> dict[str, Any]:
    """A route's body (RequestBodyMiddleware has capped its size) parsed by parse_json_body."""
    raw = await request.body()
    if len(raw) > _PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(parse_json_body, raw)
    return parse_json_body(raw)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or APIError(400) naming what is wrong and where."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(
            400,
            f"request body is not valid UTF-8 (at byte {exc.start}); send JSON encoded as UTF-8",
            code="invalid_json",
        ) from None
    _check_num_values(raw)
    try:
        try:
            data = json.loads(text, parse_float=_parse_float, parse_constant=_parse_constant)
        except json.JSONDecodeError:
            raise
        except ValueError:
            # An integer over Python's int-digits limit: parse again with a hook that marks
            # long integers, so the walk can say where it was (hostile bodies only).
            data = json.loads(
                text,
                parse_int=_parse_int,
                parse_float=_parse_float,
                parse_constant=_parse_constant,
            )
    except RecursionError:
        raise _too_deep(None) from None
    except json.JSONDecodeError as exc:
        raise APIError(
            400,
            f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
            code="invalid_json",
        ) from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_request_body")
    _check_tree(data, check_strings=_SURROGATE_ESCAPE.search(text) is not None)
    return data


def _check_num_values(raw: bytes) -> None:
    """Refuse a body that could hold more than MAX_JSON_VALUES values, before parsing it.

    Every value but the root follows a `[`, `,` or `:`, and every key has its `:`, so this
    bound is never low; separators inside strings make it high, which only a text far
    beyond any model's length could exploit. A value takes at least two bytes, so short
    bodies need no counting (base64 images are long strings: three fast byte counts).
    """
    if len(raw) <= 2 * MAX_JSON_VALUES:
        return
    bound = 1 + raw.count(b"[") + raw.count(b",") + 2 * raw.count(b":")
    if bound > MAX_JSON_VALUES:
        raise APIError(
            400,
            f"request body has too many JSON values (up to {bound}; the limit is "
            f"{MAX_JSON_VALUES}); send images as data: or http(s) URLs and fewer values",
            code="invalid_json",
        )


def _parse_int(digits: str) -> int | _BadValue:
    if len(digits) > MAX_NUMBER_CHARS:
        return _long_number(len(digits))
    return int(digits)


def _long_number(num_chars: int | None) -> _BadValue:
    size = f"{num_chars} characters" if num_chars else f"more than {MAX_NUMBER_CHARS} digits"
    return _BadValue(f"a number of {size}; the limit is {MAX_NUMBER_CHARS} characters")


def _parse_float(text: str) -> float | _BadValue:
    if len(text) > MAX_NUMBER_CHARS:
        return _long_number(len(text))
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses as inf
        return _BadValue(f"{text} is out of the range of a 64-bit float; send a finite number")
    return value


def _parse_constant(name: str) -> _BadValue:
    return _BadValue(f"{name} is not valid JSON; send a finite number")


def _check_tree(root: dict[str, Any], *, check_strings: bool) -> None:
    """One depth-first walk: depth, refused numbers, and (when needed) lone surrogates.

    The stack holds one (items iterator, path) per open container, so it never outgrows
    MAX_DEPTH whatever the body's width.
    """
    stack: list[tuple[Iterator[tuple[Any, Any]], tuple[Any, ...], bool]] = [
        (iter(root.items()), (), True)
    ]
    while stack:
        items, path, is_dict = stack[-1]
        for key, value in items:
            if is_dict and check_strings and _SURROGATE.search(key):
                raise _not_unicode((*path, key))
            kind = type(value)  # exact types: json.loads makes no subclasses
            if kind is int:
                if not -_INT_LIMIT < value < _INT_LIMIT:
                    raise _refused((*path, key), _long_number(None))
            elif kind is str:
                if check_strings and _SURROGATE.search(value):
                    raise _not_unicode((*path, key))
            elif kind is dict or kind is list:
                child_path = (*path, key)
                if len(child_path) >= MAX_DEPTH:
                    raise _too_deep(child_path)
                child = iter(value.items()) if kind is dict else enumerate(value)
                stack.append((child, child_path, kind is dict))
                break  # descend; this container's iterator resumes after the child
            elif kind is _BadValue:
                raise _refused((*path, key), value)
        else:
            stack.pop()


def _refused(path: tuple[Any, ...], value: _BadValue) -> APIError:
    dotted = dotted_path(path)
    return APIError(400, f"{dotted}: {value.reason}", code="invalid_json", param=dotted)


def _too_deep(path: tuple[Any, ...] | None) -> APIError:
    where = f" at {dotted_path(path)}" if path else ""
    return APIError(
        400,
        f"request body is nested more than {MAX_DEPTH} levels deep{where}; flatten it",
        code="invalid_json",
        param=dotted_path(path) if path else None,
    )


def _not_unicode(path: tuple[Any, ...]) -> APIError:
    dotted = dotted_path(path)
    return APIError(
        400,
        f"{dotted}: the string is not valid Unicode (a lone surrogate such as \\ud800); "
        "send valid UTF-16 escape pairs or plain UTF-8 text",
        code="invalid_json",
        param=dotted,
    )
