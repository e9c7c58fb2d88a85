"""The request fields that ask for structured output, read into one StructuredOutputParams.

OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs` (json,
regex, choice, grammar, json_object) and its older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`. At most one may be sent; the spec is compiled here, in the
API process, so a bad schema is a 400 naming the field before the request is queued.
"""

from __future__ import annotations

import json
from typing import Any

from mmserve.errors import InvalidRequestError
from mmserve.structured_output.compiler import check_structured_output
from mmserve.structured_output.params import StructuredOutputParams

# structured_outputs keys that change nothing here: we never fall back to another backend, and
# JSON output never has free whitespace (docs/structured_output.md).
_NO_OP_KEYS = ("disable_fallback", "disable_any_whitespace")
_SPEC_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_output_from_fields(fields: Any) -> StructuredOutputParams | None:
    """The structured output a request body asks for (None for free text), compiled once to
    check it; raises InvalidRequestError naming the field at fault."""
    # (the field, the path of its spec for error messages, what it asks for)
    found: list[tuple[str, str, StructuredOutputParams]] = []
    if fields.response_format is not None:
        asked = _from_response_format(fields.response_format)
        if asked is not None:
            found.append(("response_format", *asked))
    if fields.structured_outputs is not None:
        found.append(("structured_outputs", *_from_structured_outputs(fields.structured_outputs)))
    for name, kind in (
        ("guided_json", "json_schema"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(fields, name)
        if value is not None:
            found.append((name, name, _spec(kind, value, name)))
    if not found:
        return None
    if len(found) > 1:
        names = " and ".join(name for name, _, _ in found)
        raise InvalidRequestError(
            f"{names} each ask for structured output; send only one of them",
            param=found[1][0],
        )
    _, param, params = found[0]
    check_structured_output(params, param=param)
    return params


def _from_response_format(value: dict[str, Any]) -> tuple[str, StructuredOutputParams] | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", StructuredOutputParams.json_object()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError(
                'response_format.json_schema must be an object {"name": ..., "schema": {...}}',
                param="response_format.json_schema",
            )
        if "schema" not in spec:
            raise InvalidRequestError(
                "response_format.json_schema.schema is required: the JSON schema to follow",
                param="response_format.json_schema.schema",
            )
        param = "response_format.json_schema.schema"
        return param, _json_schema(spec["schema"], param)
    raise InvalidRequestError(
        f"response_format.type must be text, json_object or json_schema, got {_short(kind)}",
        param="response_format.type",
    )


def _from_structured_outputs(value: dict[str, Any]) -> tuple[str, StructuredOutputParams]:
    for key, item in value.items():
        if item is not None and key not in _SPEC_KEYS and key not in _NO_OP_KEYS:
            raise InvalidRequestError(
                f"structured_outputs.{key} is not supported by this server; supported: "
                f"{', '.join(_SPEC_KEYS)}",
                param=f"structured_outputs.{key}",
            )
    keys = [k for k in _SPEC_KEYS if value.get(k) not in (None, False)]
    if len(keys) != 1:
        raise InvalidRequestError(
            f"structured_outputs must set exactly one of {', '.join(_SPEC_KEYS)}"
            + (f", got {' and '.join(keys)}" if keys else ""),
            param="structured_outputs",
        )
    key = keys[0]
    param = f"structured_outputs.{key}"
    item = value[key]
    if key == "json_object":
        if item is not True:
            raise InvalidRequestError("structured_outputs.json_object must be true", param=param)
        return param, StructuredOutputParams.json_object()
    return param, _spec("json_schema" if key == "json" else key, item, param)


def _json_schema(schema: Any, param: str) -> StructuredOutputParams:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequestError(
                f"{param} is not valid JSON: {exc}"[:300], param=param
            ) from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(f"{param} must be a JSON schema object", param=param)
    return _renamed(lambda: StructuredOutputParams.json(json.dumps(schema)), param)


def _spec(kind: str, value: Any, param: str) -> StructuredOutputParams:
    if kind == "json_schema":
        return _json_schema(value, param)
    if kind == "choice":
        if not isinstance(value, list):
            raise InvalidRequestError(f"{param} must be a list of strings", param=param)
        return _renamed(lambda: StructuredOutputParams.choice(value), param)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{param} must be a string", param=param)
    return _renamed(lambda: StructuredOutputParams(kind, value), param)


def _renamed(build: Any, param: str) -> StructuredOutputParams:
    """StructuredOutputParams names its own field; the client sent `param`."""
    try:
        return build()
    except InvalidRequestError as exc:
        message = exc.message.replace("structured_outputs", param)
        raise InvalidRequestError(message, param=param) from None


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, str | int | float | bool | None) else "an object"
    return text if len(text) <= 40 else text[:37] + "..."
