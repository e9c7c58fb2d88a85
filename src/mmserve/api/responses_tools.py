"""Function tools of the Responses API on top of chat's tool calling (`api/tools.py`).

Responses' `{"type": "function", "name", "description", "parameters", "strict"}` becomes chat's
`{"type": "function", "function": {...}}`; `tool_choice` `{"type": "function", "name"}` becomes
chat's named choice; `function_call` input items become an assistant message's `tool_calls` and
`function_call_output` items `tool` messages; the calls the chat parser reads out of an answer
become `function_call` output items.
"""

from __future__ import annotations

import json
from typing import Any

from mmserve.errors import InvalidRequestError

_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type")
        if kind != "function":
            raise InvalidRequestError(
                f"{where}.type {json.dumps(kind)[:40]} is not supported; only function tools "
                '({"type": "function", "name": ..., "parameters": {...}})',
                param=f"{where}.type",
            )
        unknown = sorted(set(tool) - _TOOL_KEYS)
        if unknown:
            raise InvalidRequestError(
                f"{where}.{unknown[0][:64]} is not supported in a function tool",
                param=f"{where}.{unknown[0]}",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or set(choice) - {"type", "name"}:
        raise InvalidRequestError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": choice.get("name")}}


def function_call_message(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A `function_call` input item: an assistant turn holding that call."""
    _only_strings(item, ("call_id", "name", "arguments"), {"type", "id", "status"}, where)
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def function_output_message(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A `function_call_output` input item: the tool's answer to a call."""
    _only_strings(item, ("call_id", "output"), {"type", "id", "status"}, where)
    return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}


def _only_strings(item: dict[str, Any], keys: tuple[str, ...], other: set[str], where: str) -> None:
    unknown = sorted(set(item) - set(keys) - other)
    if unknown:
        raise InvalidRequestError(
            f"{where}.{unknown[0][:64]} is not a field of a {item.get('type')} item",
            param=f"{where}.{unknown[0]}",
        )
    for key in keys:
        if not isinstance(item.get(key), str):
            raise InvalidRequestError(f"{where}.{key} must be a string", param=f"{where}.{key}")


def function_call_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool calls of a parsed chat answer as `function_call` output items."""
    return [
        {
            "type": "function_call",
            "id": f"fc_{call['id']}",
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
            "status": "completed",
        }
        for call in message.get("tool_calls") or []
    ]
