"""What a request asks its output to match: one kind of grammar and its text."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from mmserve.errors import InvalidRequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# A spec is compiled in the API process and again in the engine core: bound what one costs.
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 1024
PARAM = "structured_outputs"


class StructuredOutputParams(
    msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True
):
    """One grammar for the output (vLLM's `structured_outputs`); the same value in-process and
    on the wire, checked again when decoded.

    `kind` is json_schema (spec: the schema as JSON text), json_object (no spec: any JSON
    object), regex (the pattern), choice (a JSON list of the allowed strings) or grammar (Lark,
    or llama.cpp GBNF/EBNF). Build one with the class methods, e.g.
    `StructuredOutputParams.json({"type": "object", ...})` or `.choice(["yes", "no"])`.
    Only the shape is checked here; whether the grammar compiles is the compiler's check
    (`structured_output.compiler`), done before a request is queued.
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(
                f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r:.64}",
                param=PARAM,
            )
        if not isinstance(self.spec, str):
            raise InvalidRequestError(
                f"the {self.kind} of structured_outputs must be a string", param=PARAM
            )
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(
                f"the {self.kind} of structured_outputs has {len(self.spec)} characters, at "
                f"most {MAX_SPEC_CHARS} are allowed",
                param=PARAM,
            )
        if self.kind == "json_object":
            if self.spec:
                raise InvalidRequestError("json_object takes no spec", param=PARAM)
        elif not self.spec:
            raise InvalidRequestError(
                f"the {self.kind} of structured_outputs must not be empty", param=PARAM
            )
        if self.kind == "json_schema":
            _check_schema_text(self.spec)
        if self.kind == "choice":
            _check_choices(self.spec)

    @classmethod
    def json(cls, schema: dict[str, Any] | str) -> StructuredOutputParams:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> StructuredOutputParams:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutputParams:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> StructuredOutputParams:
        if not isinstance(choices, list | tuple):
            raise InvalidRequestError("choice must be a list of strings", param=PARAM)
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutputParams:
        return cls("grammar", text)


def _check_schema_text(spec: str) -> None:
    try:
        schema = json.loads(spec)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(
            f"the json schema of structured_outputs is not valid JSON: {exc}"[:300], param=PARAM
        ) from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(
            "a json schema must be a JSON object (or true/false)", param=PARAM
        )


def _check_choices(spec: str) -> None:
    try:
        choices = json.loads(spec)
    except ValueError:
        choices = None
    if (
        not isinstance(choices, list)
        or not 0 < len(choices) <= MAX_CHOICES
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise InvalidRequestError(
            f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings", param=PARAM
        )
