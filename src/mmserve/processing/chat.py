"""OpenAI-style chat messages -> the chat template's input plus the ordered list of images."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from mmserve.errors import InvalidRequestError

ROLES = ("system", "user", "assistant", "tool", "developer")
# A caller UUID names an item in its namespace's index; a bound keeps one request from
# storing megabytes of name (the index holds entries, not bytes).
MAX_UUID_CHARS = 256


@dataclass(frozen=True, slots=True)
class ChatImage:
    """One image part, in prompt order. `source` is None for a UUID-only reference."""

    source: Image.Image | bytes | str | None
    uuid: str | None = None


@dataclass(frozen=True)
class ParsedChat:
    """Messages in the shape the chat template expects, and the images their parts named."""

    messages: list[dict[str, Any]]
    images: list[ChatImage] = field(default_factory=list)

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
                f"{where} contains the reserved token {token!r}; send images as image_url "
                "content parts instead of typing the model's vision tokens",
                param="messages",
            )


def _parse_image_part(part: Mapping[str, Any], index: str) -> ChatImage:
    kind = part.get("type")
    if kind == "image":  # offline API: a PIL image (or bytes/URL) directly in the part
        source = part.get("image")
        return ChatImage(source=source, uuid=_part_uuid(part.get("uuid"), f"{index}.uuid"))
    image_url = part.get("image_url")
    if isinstance(image_url, str):
        image_url = {"url": image_url}
    if not isinstance(image_url, Mapping):
        raise InvalidRequestError(
            f'{index}.image_url must be an object like {{"url": "data:image/png;base64,..."}}',
            param="messages",
        )
    url = image_url.get("url") or None
    if image_url.get("uuid") is not None:
        uuid = _part_uuid(image_url["uuid"], f"{index}.image_url.uuid")
    else:
        uuid = _part_uuid(part.get("uuid"), f"{index}.uuid")
    if url is not None and not isinstance(url, str):
        raise InvalidRequestError(f"{index}.image_url.url must be a string", param="messages")
    if url is None and uuid is None:
        raise InvalidRequestError(
            f"{index}.image_url needs a url (or a uuid of an image sent before)", param="messages"
        )
    return ChatImage(source=url, uuid=uuid)


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
    messages: Sequence[Mapping[str, Any]], reserved_tokens: Sequence[str]
) -> ParsedChat:
    """Validate messages, refuse typed vision tokens, and collect image parts in order."""
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
        content = message.get("content")
        if content is None:
            content = ""
        if isinstance(content, str):
            check_user_text(content, reserved_tokens, f"{where}.content")
            rendered.append({"role": role, "content": content})
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
            elif kind in ("image_url", "image"):
                images.append(_parse_image_part(part, pwhere))
                parts.append({"type": "image"})
            else:
                raise InvalidRequestError(
                    f"{pwhere} has unsupported type {kind!r}; use 'text' or 'image_url'",
                    param="messages",
                )
        rendered.append({"role": role, "content": parts})
    return ParsedChat(messages=rendered, images=images)
