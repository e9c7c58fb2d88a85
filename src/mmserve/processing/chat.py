"""OpenAI-style chat messages -> the chat template's input plus the ordered list of items."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from PIL import Image

from mmserve.errors import InvalidRequestError

# The roles a chat message may have, for the HTTP schema and the offline chat alike.
Role = Literal["system", "user", "assistant", "tool", "developer"]
ROLES: tuple[str, ...] = get_args(Role)
# A caller UUID names an item in its namespace's index; a bound keeps one request from
# storing megabytes of name (the index holds entries, not bytes).
MAX_UUID_CHARS = 256


@dataclass(frozen=True, slots=True)
class ChatImage:
    """One image or video part, in prompt order. `source` is None for a UUID-only reference;
    a video's source may also be frames (offline)."""

    source: Image.Image | bytes | str | Any | None
    uuid: str | None = None
    modality: str = "image"


@dataclass(frozen=True)
class ParsedChat:
    """Messages in the shape the chat template expects, and the items their parts named."""

    messages: list[dict[str, Any]]
    images: list[ChatImage] = field(default_factory=list)  # images and videos, in order

    @property
    def uuids(self) -> list[str | None]:
        return [img.uuid for img in self.images]


def check_user_text(text: str, reserved_tokens: Sequence[str], where: str) -> None:
    """Refuse text that spells one of the model's vision/pad special tokens.

    Only the chat template may place them (from image parts); text that carries them would
    reach the placeholder splice as if it were an image.
    """
    for token in reserved_tokens:
        if token in text:
            raise InvalidRequestError(
                f"{where} contains the reserved token {token!r}; send images and videos as "
                "image_url / video_url content parts instead of typing the model's vision tokens",
                param="messages",
            )


_EXAMPLE_URLS = {"image": "data:image/png;base64,...", "video": "data:video/mp4;base64,..."}


def _parse_media_part(part: Mapping[str, Any], index: str, modality: str) -> ChatImage:
    """An `image_url` / `video_url` part, or (offline API) an `image` / `video` part that
    carries the item itself (a PIL image, frames, bytes or a URL)."""
    if part.get("type") == modality:
        source = part.get(modality)
        uuid = _part_uuid(part.get("uuid"), f"{index}.uuid")
        return ChatImage(source=source, uuid=uuid, modality=modality)
    key = f"{modality}_url"
    media_url = part.get(key)
    if isinstance(media_url, str):
        media_url = {"url": media_url}
    if not isinstance(media_url, Mapping):
        raise InvalidRequestError(
            f'{index}.{key} must be an object like {{"url": "{_EXAMPLE_URLS[modality]}"}}',
            param="messages",
        )
    url = media_url.get("url") or None
    if media_url.get("uuid") is not None:
        uuid = _part_uuid(media_url["uuid"], f"{index}.{key}.uuid")
    else:
        uuid = _part_uuid(part.get("uuid"), f"{index}.uuid")
    if url is not None and not isinstance(url, str):
        raise InvalidRequestError(f"{index}.{key}.url must be a string", param="messages")
    if url is None and uuid is None:
        raise InvalidRequestError(
            f"{index}.{key} needs a url (or a uuid of {'an' if modality == 'image' else 'a'} "
            f"{modality} sent before)",
            param="messages",
        )
    return ChatImage(source=url, uuid=uuid, modality=modality)


def check_media_uuid(value: Any, where: str, param: str) -> str:
    """A caller UUID: a non-empty string of at most MAX_UUID_CHARS printable characters."""
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(
            f"{where} must be a non-empty string, got {type(value).__name__}", param=param
        )
    if len(value) > MAX_UUID_CHARS:
        raise InvalidRequestError(
            f"{where} is {len(value)} characters long; a uuid has at most {MAX_UUID_CHARS}",
            param=param,
        )
    if not value.isprintable():
        raise InvalidRequestError(
            f"{where} contains a control, line-break or unpaired surrogate character; a uuid "
            "is printable text",
            param=param,
        )
    return value


def _part_uuid(value: Any, where: str) -> str | None:
    return None if value is None else check_media_uuid(value, where, param="messages")


def parse_chat_messages(
    messages: Sequence[Mapping[str, Any]],
    reserved_tokens: Sequence[str],
    *,
    tools: Sequence[Any] | None = None,
) -> ParsedChat:
    """Validate messages, refuse typed vision tokens (in the messages and in the `tools` the
    template will render), and collect image and video parts in order."""
    if tools:
        check_tools_text(tools, reserved_tokens)
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    rendered: list[dict[str, Any]] = []
    images: list[ChatImage] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"{where} must be an object", param="messages")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(
                f"{where}.role must be one of {list(ROLES)}, got {role!r}", param="messages"
            )
        extras = _turn_fields(message, where, reserved_tokens)
        content = message.get("content")
        if content is None:
            content = ""
        if isinstance(content, str):
            check_user_text(content, reserved_tokens, f"{where}.content")
            rendered.append({"role": role, "content": content, **extras})
            continue
        if not isinstance(content, Sequence):
            raise InvalidRequestError(
                f"{where}.content must be a string or a list of parts", param="messages"
            )
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            pwhere = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise InvalidRequestError(f"{pwhere}.text must be a string", param="messages")
                check_user_text(text, reserved_tokens, pwhere)
                parts.append({"type": "text", "text": text})
            elif kind in ("image_url", "image", "video_url", "video"):
                modality = "video" if kind.startswith("video") else "image"
                images.append(_parse_media_part(part, pwhere, modality))
                parts.append({"type": modality})
            else:
                raise InvalidRequestError(
                    f"{pwhere} has unsupported type {kind!r}; use 'text', 'image_url' or "
                    "'video_url'",
                    param="messages",
                )
        rendered.append({"role": role, "content": parts, **extras})
    return ParsedChat(messages=rendered, images=images)


def _turn_fields(
    message: Mapping[str, Any], where: str, reserved_tokens: Sequence[str]
) -> dict[str, Any]:
    """An assistant turn's tool calls (arguments as objects, as chat templates render them),
    a tool result's tool_call_id, an assistant turn's reasoning_content."""
    extras: dict[str, Any] = {}
    for key in ("tool_call_id", "reasoning_content"):
        value = message.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise InvalidRequestError(f"{where}.{key} must be a string", param="messages")
        check_user_text(value, reserved_tokens, f"{where}.{key}")
        extras[key] = value
    calls = message.get("tool_calls")
    if calls is not None:
        if message.get("role") != "assistant" or not isinstance(calls, Sequence):
            raise InvalidRequestError(
                f"{where}.tool_calls must be a list, on an assistant message", param="messages"
            )
        extras["tool_calls"] = [
            _tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)
        ]
        rendered = json.dumps(extras["tool_calls"], ensure_ascii=False)
        check_user_text(rendered, reserved_tokens, f"{where}.tool_calls")
    return extras


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(
            f'{where} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
            '"arguments": "{...}"}}',
            param="messages",
        )
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            raise InvalidRequestError(
                f"{where}.function.arguments is not valid JSON", param="messages"
            ) from None
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def check_tools_text(tools: Sequence[Any], reserved_tokens: Sequence[str]) -> None:
    """Refuse tool definitions that spell a vision token (the template renders them into the
    prompt, where it would read as an image's placeholder)."""
    text = json.dumps(list(tools), ensure_ascii=False)
    for token in reserved_tokens:
        if token in text:
            raise InvalidRequestError(
                f"tools contain the reserved token {token!r}; remove it from the tool definitions",
                param="tools",
            )
