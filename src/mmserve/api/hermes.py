"""The hermes tool-call format (Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>` in the model's text, read whole or as the text streams in.

As vLLM's hermes parser: the content is the text before the first `<tool_call>` (None when
empty); a call whose closing tag never came is still read when its JSON is complete; a call
that does not parse makes the whole text content, with no calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

START = "<tool_call>"
END = "</tool_call>"
_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME_RE = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGS_RE = re.compile(r'"arguments"\s*:\s*')


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: new_call_id())

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer; (text, []) when it holds no call that parses."""
    if START not in text:
        return text, []
    calls = []
    for closed, open_ended in _CALL_RE.findall(text):
        call = _call_of(closed or open_ended)
        if call is None:
            return text, []
        calls.append(call)
    content = text[: text.index(START)]
    return content or None, calls


def _call_of(body: str) -> ToolCall | None:
    try:
        value = json.loads(body.strip())
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if "arguments" not in value:
        return None
    args = value["arguments"]
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(value["name"], text)


def partial_overlap(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def json_value_end(text: str, start: int) -> int | None:
    """The index just after the JSON object or array that opens at `start` (None: not yet
    closed). Strings are skipped with their escapes."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


@dataclass
class _StreamedCall:
    id: str
    name: str | None = None
    args_sent: int = 0  # characters of the arguments text sent
    done: bool = False


class HermesStream:
    """The hermes parser over a streamed answer: `feed` each text delta, then `finish`.

    Each returns (content delta, tool-call deltas): a call's first delta carries its index, id,
    type and name; later ones carry fragments of its arguments text, which add up to the
    arguments as the model wrote them. Text that might still become a `<tool_call>` is held back.
    """

    def __init__(self) -> None:
        self.text = ""
        self._content_sent = 0
        self._calls: list[_StreamedCall] = []

    @property
    def num_calls(self) -> int:
        return sum(1 for c in self._calls if c.name is not None)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        text = self.text
        first = text.find(START)
        content_end = len(text) - partial_overlap(text, START) if first == -1 else first
        content = text[self._content_sent : content_end]
        self._content_sent = max(self._content_sent, content_end)
        if first == -1:
            return content, []
        return content, self._call_deltas(text, first)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left: held-back text, or, when no call came out, the unparsed rest as
        content (the whole answer then reads as text, as it would unstreamed)."""
        text = self.text
        if START not in text or self.num_calls == 0:
            rest = text[self._content_sent :]
            self._content_sent = len(text)
            return rest, []
        return "", self._call_deltas(text, text.index(START), final=True)

    def _call_deltas(self, text: str, first: int, final: bool = False) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        pos = first
        index = 0
        while pos != -1 and pos < len(text):
            body_start = pos + len(START)
            end = text.find(END, body_start)
            body = text[body_start : len(text) if end == -1 else end]
            if index == len(self._calls):
                self._calls.append(_StreamedCall(new_call_id()))
            call = self._calls[index]
            if not self._advance(call, index, body, end != -1 or final, deltas):
                break
            index += 1
            pos = -1 if end == -1 else text.find(START, end + len(END))
        return deltas

    def _advance(
        self, call: _StreamedCall, index: int, body: str, closed: bool, out: list[dict[str, Any]]
    ) -> bool:
        """Send what is new of one call; False when it cannot go on (its name is not known)."""
        if call.name is None:
            match = _NAME_RE.search(body)
            if match is None:
                return False
            try:
                call.name = json.loads(match.group(1))
            except (ValueError, RecursionError):
                return False
            out.append(
                {
                    "index": index,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            )
        if call.done:
            return True
        args = _ARGS_RE.search(body)
        if args is None:
            return True
        value_start = args.end()
        if value_start < len(body) and body[value_start] in "{[":
            value_end = json_value_end(body, value_start)
            sendable = body[value_start : len(body) if value_end is None else value_end]
            call.done = value_end is not None
        elif closed:  # a string or other scalar: sent whole once the call is complete
            parsed = _call_of(body)
            sendable = parsed.arguments if parsed is not None else ""
            call.done = True
        else:
            return True
        if len(sendable) > call.args_sent:
            fragment = sendable[call.args_sent :]
            call.args_sent = len(sendable)
            out.append({"index": index, "function": {"arguments": fragment}})
        return True
