"""A chat request's `tools` and `tool_choice`: checked, and turned into what the answer needs.

`tool_choice` is one of (OpenAI's, as vLLM serves them):

- `none`: the tools reach the chat template, the answer is returned as text;
- `auto` (the default when tools are given): the answer is parsed for tool calls by the
  server's `--tool-call-parser`, and needs `--enable-auto-tool-choice`;
- `required`: the grammar engine makes the model write a JSON array of one or more
  `{"name": ..., "parameters": {...}}` objects, each a tool of the request with arguments
  that satisfy its parameters schema (the schema vLLM builds);
- `{"type": "function", "function": {"name": ...}}`: the grammar makes the model write that
  function's arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from mmserve.errors import InvalidRequestError
from mmserve.sampling_params import SamplingParams
from mmserve.structured_output.compiler import check_structured_output
from mmserve.structured_output.params import StructuredOutputParams

ToolMode = Literal["none", "auto", "required", "named"]
_EMPTY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}
_NAMED_EXAMPLE = '{"type": "function", "function": {"name": "my_function"}}'


@dataclass(frozen=True)
class FunctionTool:
    """One function of `tools`: its name, and its parameters' JSON schema."""

    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolRequest:
    """What a request's tools ask of its answer."""

    mode: ToolMode
    tools: tuple[FunctionTool, ...]
    template_tools: list[dict[str, Any]] | None  # `tools` as the chat template receives them
    function_name: str | None = None  # the function of a named tool_choice
    parallel_tool_calls: bool = True

    @property
    def is_constrained(self) -> bool:
        return self.mode in ("required", "named")

    def structured_output(self) -> StructuredOutputParams | None:
        """The grammar of a required or named tool_choice (None for none and auto), compiled
        once to check it: a parameters schema the grammar engine refuses is a 400."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.name == self.function_name)
            schema = tool.parameters
        elif self.mode == "required":
            schema = self._calls_schema()
        else:
            return None
        try:
            params = StructuredOutputParams.json(json.dumps(schema))
            check_structured_output(params, param="tools")
        except InvalidRequestError as exc:
            raise InvalidRequestError(
                f"tools: a function's parameters schema cannot constrain the answer: {exc.message}"[
                    :600
                ],
                param="tools",
            ) from None
        return params

    def _calls_schema(self) -> dict[str, Any]:
        """A JSON array of calls, each `{"name": one of the tools, "parameters": its args}`."""
        defs: dict[str, Any] = {}
        alternatives = []
        for tool in self.tools:
            params = dict(tool.parameters)
            for key, value in (params.pop("$defs", None) or {}).items():
                if key in defs and defs[key] != value:
                    raise InvalidRequestError(
                        f"tools: two functions define $defs.{key} differently; with "
                        'tool_choice "required" their $defs share one namespace, rename one',
                        param="tools",
                    )
                defs[key] = value
            alternatives.append(
                {
                    "properties": {
                        "name": {"type": "string", "enum": [tool.name]},
                        "parameters": params,
                    },
                    "required": ["name", "parameters"],
                    # vLLM leaves this out; without it a model may add keys to a call forever
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": alternatives},
        }
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema


def tool_request(
    tools: Any,
    tool_choice: Any,
    parallel_tool_calls: Any,
    *,
    enable_auto_tool_choice: bool,
) -> ToolRequest | None:
    """Check `tools` / `tool_choice` / `parallel_tool_calls` (None: the request has no tools);
    every mistake is a 400 naming the field."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError(
            "parallel_tool_calls must be true or false", param="parallel_tool_calls"
        )
    if tools is None:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError(
                f"tool_choice is {_short(tool_choice)} but the request has no tools; send "
                "tools, or omit tool_choice",
                param="tool_choice",
            )
        return None
    checked = _check_tools(tools)
    mode, name = _check_choice("auto" if tool_choice is None else tool_choice, checked)
    if mode == "auto" and not enable_auto_tool_choice:
        raise InvalidRequestError(
            'tool_choice "auto" (the default when tools are given) needs a server started '
            'with --enable-auto-tool-choice and --tool-call-parser; send tool_choice "none", '
            '"required" or a named function instead',
            param="tool_choice",
        )
    return ToolRequest(
        mode=mode,
        tools=checked,
        template_tools=tools,
        function_name=name,
        parallel_tool_calls=parallel_tool_calls is not False,
    )


def _check_tools(tools: Any) -> tuple[FunctionTool, ...]:
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError(
            "tools must be a non-empty list of "
            '{"type": "function", "function": {"name": ..., "parameters": {...}}}; omit it '
            "to send no tools",
            param="tools",
        )
    out: list[FunctionTool] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequestError(
                f'{where} must be an object with "type": "function" (the only tool type '
                "this server serves)",
                param=f"{where}.type",
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError(
                f'{where}.function must be an object {{"name": ..., "parameters": {{...}}}}',
                param=f"{where}.function",
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(
                f"{where}.function.name must be a non-empty string", param=f"{where}.function.name"
            )
        if name in seen:
            raise InvalidRequestError(
                f"{where}.function.name {_short(name)} names a second function; tool names "
                "must be unique",
                param=f"{where}.function.name",
            )
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError(
                f"{where}.function.description must be a string",
                param=f"{where}.function.description",
            )
        params = function.get("parameters")
        if params is None:
            params = _EMPTY_OBJECT_SCHEMA
        elif not isinstance(params, dict) or params.get("type", "object") != "object":
            raise InvalidRequestError(
                f"{where}.function.parameters must be a JSON schema of an object "
                '({"type": "object", "properties": {...}})',
                param=f"{where}.function.parameters",
            )
        out.append(FunctionTool(name, params))
    return tuple(out)


def _check_choice(choice: Any, tools: tuple[FunctionTool, ...]) -> tuple[ToolMode, str | None]:
    if choice in ("none", "auto", "required"):
        return choice, None
    if not isinstance(choice, dict):
        raise InvalidRequestError(
            f'tool_choice must be "none", "auto", "required" or {_NAMED_EXAMPLE}, got '
            f"{_short(choice)}",
            param="tool_choice",
        )
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict):
        raise InvalidRequestError(
            f"a named tool_choice is {_NAMED_EXAMPLE}", param="tool_choice.function"
        )
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(
            f"tool_choice.function.name must be a non-empty string ({_NAMED_EXAMPLE})",
            param="tool_choice.function.name",
        )
    if name not in {t.name for t in tools}:
        known = ", ".join(repr(t.name) for t in tools[:20])
        raise InvalidRequestError(
            f"tool_choice names the function {_short(name)}, which is not in tools ({known})",
            param="tool_choice.function.name",
        )
    return "named", name


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, str | int | float | bool | None) else "an object"
    return text if len(text) <= 60 else text[:57] + "..."


def with_tools(params: SamplingParams, tools: ToolRequest | None) -> SamplingParams:
    """`params` with what the tools ask: the grammar of a required or named tool_choice
    (refused beside another structured output), special tokens kept for the auto parser."""
    if tools is None:
        return params
    if tools.is_constrained:
        if params.structured_outputs is not None:
            raise InvalidRequestError(
                f'tool_choice "{tools.mode}" constrains the answer to tool calls, and the '
                "request also asks for structured output (response_format, structured_outputs "
                "or guided_*); send only one of them",
                param="tool_choice",
            )
        return msgspec.structs.replace(params, structured_outputs=tools.structured_output())
    if tools.mode == "auto":
        # As vLLM: a tokenizer may mark <tool_call> special; the parser must still see it.
        return msgspec.structs.replace(params, skip_special_tokens=False)
    return params
