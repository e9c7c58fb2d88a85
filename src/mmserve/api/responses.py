"""POST /v1/responses: a Responses API request becomes the chat completion request it means.

The translation is the whole trick: `input` and `instructions` become chat messages, and
`max_output_tokens`, `temperature`, `top_p`, `text.format`, ... become the chat request's
fields, so a response runs exactly the chat path (same template, same media processing, same
SamplingParams) and the same input gives the same text as `chat.completions.create`.

Stateless: nothing is stored, so `store: true` and `previous_response_id` are refused (vLLM
without VLLM_ENABLE_RESPONSES_API_STORE silently treats `store: true` as false; we say so
instead, and an omitted `store` is read as false). Refusals name the Responses field.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from typing import Any

from pydantic import ValidationError

from mmserve.api.errors import APIError, validation_error
from mmserve.api.protocol import ChatCompletionRequest
from mmserve.api.responses_protocol import NO_OP_FIELDS, REFUSAL_REASONS, ResponsesRequest
from mmserve.api.responses_tools import (
    chat_tool_choice,
    chat_tools,
    function_call_message,
    function_output_message,
)
from mmserve.api.unsupported import same_json_value
from mmserve.errors import InvalidRequestError

# Where a chat field's error points in the Responses body (longest prefix first).
_PARAM_NAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("tool_choice.function", "tool_choice"),
    ("messages", "input"),
)


class ResponsesChatRequest(ChatCompletionRequest):
    """The chat request a Responses request means; range errors name `max_output_tokens`."""

    @property
    def max_tokens_field(self) -> str:
        return "max_output_tokens"


def parse_responses_request(data: dict[str, Any]) -> ResponsesRequest:
    """The typed body; every unknown, stateful or unsupported field is a 400 naming it."""
    try:
        body = ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    if body.store:
        raise InvalidRequestError(
            "store: true is not supported: this server keeps no responses (it is stateless); "
            "send store: false or omit it",
            param="store",
        )
    if body.previous_response_id is not None:
        raise InvalidRequestError(
            "previous_response_id is not supported: this server keeps no responses (it is "
            "stateless); send the whole conversation in input instead",
            param="previous_response_id",
        )
    for field, neutral in NO_OP_FIELDS.items():
        value = data.get(field)
        if value is None or any(same_json_value(value, n) for n in neutral):
            continue
        reason = REFUSAL_REASONS.get(field, "it is not supported by this server")
        hint = f"omit it or send {json.dumps(neutral[0])}" if neutral else "omit it"
        raise InvalidRequestError(f"{field} cannot be served: {reason}; {hint}", param=field)
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise InvalidRequestError(
            "text.verbosity cannot be served: this model has no verbosity control; omit it "
            'or send "medium"',
            param="text.verbosity",
        )
    return body


def to_chat_request(body: ResponsesRequest) -> ResponsesChatRequest:
    """The chat completion request with the same meaning as `body`."""
    messages = chat_messages(body.input, body.instructions)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "min_tokens": body.min_tokens,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "skip_special_tokens": body.skip_special_tokens,
        "cache_salt": body.cache_salt,
        "mm_processor_kwargs": body.mm_processor_kwargs,
        "chat_template_kwargs": body.chat_template_kwargs,
        "response_format": _response_format(body),
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    try:
        return ResponsesChatRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise InvalidRequestError(
            "text.format.schema is required with type json_schema: the JSON schema to follow",
            param="text.format.schema",
        )
    spec = {"name": fmt.name or "response", "schema": fmt.json_schema, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": spec}


class renamed_params(contextlib.AbstractContextManager):  # noqa: N801 (used as a `with`)
    """Errors raised on the chat path, re-pointed at the Responses fields they came from.

    `num_instruction_messages` (1 once the body has `instructions`) lets `messages[k]` in an
    error's text become the `input[k - 1]` the client sent."""

    def __init__(self) -> None:
        self.num_instruction_messages = 0

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, InvalidRequestError | APIError):
            param = _renamed(exc.param)
            if param != exc.param:
                raise self._renamed_error(exc, param) from None

    def _renamed_error(self, exc: InvalidRequestError | APIError, param: str | None) -> Exception:
        message = exc.message
        for chat_name, name in _PARAM_NAMES[:-1]:
            message = re.sub(rf"\b{re.escape(chat_name)}\b", name, message)
        message = re.sub(r"\bmessages\[(\d+)\]", self._input_index, message)
        if isinstance(exc, APIError):
            return APIError(exc.status_code, message, code=exc.code, param=param)
        return type(exc)(message, param=param)

    def _input_index(self, match: re.Match[str]) -> str:
        k = int(match.group(1)) - self.num_instruction_messages
        return "instructions" if k < 0 else f"input[{k}]"


def _renamed(param: str | None) -> str | None:
    if param is None:
        return None
    for chat_name, name in _PARAM_NAMES:
        if param == chat_name or param.startswith(chat_name + "."):
            return name + param[len(chat_name) :]
    return param


# ---- input items -> chat messages ----------------------------------------------------------

_ROLES = ("user", "assistant", "system", "developer")


def chat_messages(given: str | list[dict[str, Any]], instructions: str | None) -> list[dict]:
    """`instructions` as a system message, then each input item as a chat message."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        return messages
    if not given:
        raise InvalidRequestError("input must be a string or a non-empty list", param="input")
    for i, item in enumerate(given):
        messages.append(_message(item, f"input[{i}]"))
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind == "function_call":
        return function_call_message(item, where)
    if kind == "function_call_output":
        return function_output_message(item, where)
    if kind != "message":
        raise InvalidRequestError(
            f"{where}.type {_short(kind)} is not supported; input items are messages "
            '({"role": "user", "content": [...]})',
            param=f"{where}.type",
        )
    unknown = set(item) - {"type", "role", "content", "id", "status"}
    if unknown:
        field = sorted(unknown)[0]
        raise InvalidRequestError(
            f"{where}.{field[:64]} is not a field of an input message", param=f"{where}.{field}"
        )
    role = item.get("role")
    if role not in _ROLES:
        raise InvalidRequestError(
            f"{where}.role must be one of {list(_ROLES)}, got {_short(role)}",
            param=f"{where}.role",
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"{where}.content must be a string or a list of content parts",
            param=f"{where}.content",
        )
    parts = [_part(part, f"{where}.content[{j}]", role) for j, part in enumerate(content)]
    return {"role": role, "content": parts}


def _part(part: Any, where: str, role: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    allowed = {"type", "text"}
    if kind == "input_text" or (kind == "output_text" and role == "assistant"):
        allowed |= {"annotations", "logprobs"} if kind == "output_text" else set()
        _only(part, allowed, where)
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{where}.text must be a string", param=f"{where}.text")
        return {"type": "text", "text": text}
    if kind == "input_image":
        _only(part, {"type", "image_url", "file_id", "detail"}, where)
        if part.get("file_id") is not None:
            raise InvalidRequestError(
                f"{where}.file_id is not supported: this server has no file storage; send the "
                "image as image_url (an https:// URL or a data: URL)",
                param=f"{where}.file_id",
            )
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise InvalidRequestError(
                f"{where}.image_url must be a URL string (https:// or data:)",
                param=f"{where}.image_url",
            )
        detail = part.get("detail")
        if detail not in (None, "auto", "low", "high"):
            raise InvalidRequestError(
                f"{where}.detail must be auto, low or high, got {_short(detail)}",
                param=f"{where}.detail",
            )
        # detail is accepted and has no effect: the image is processed at its own size, under
        # the pixel caps (docs/responses.md), as chat completions do with image_url.detail.
        return {"type": "image_url", "image_url": {"url": url}}
    raise InvalidRequestError(
        f"{where}.type {_short(kind)} is not supported; use input_text or input_image"
        + (" (or output_text in an assistant message)" if role == "assistant" else ""),
        param=f"{where}.type",
    )


def _only(part: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(part) - allowed
    if unknown:
        field = sorted(unknown)[0]
        raise InvalidRequestError(
            f"{where}.{field[:64]} is not supported in a {part.get('type')} part",
            param=f"{where}.{field}",
        )


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, str | int | float | bool | None) else "an object"
    return text if len(text) <= 40 else text[:37] + "..."


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"
