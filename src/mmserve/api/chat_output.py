"""A chat answer's text read into message fields: reasoning, content and tool calls.

One `ChoiceParser` per choice. A whole answer goes through `message`; a streamed one through
`feed` (each step's text and token ids) and `finish`, which return `delta` objects or None
when there is nothing to send yet. Reasoning is split first; tool calls are read from the
content only (never from reasoning), as in vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mmserve.api.hermes import HermesStream, ToolCall, json_value_end, new_call_id, parse_tool_calls
from mmserve.api.reasoning import ReasoningStream
from mmserve.api.tools import ToolRequest


@dataclass(frozen=True)
class AnswerParsing:
    """What one request's answers are read for (built from the server's flags and the body)."""

    tools: ToolRequest | None = None
    auto_tool_parser: str | None = None  # --tool-call-parser, when tool_choice is auto
    think_token_ids: tuple[int, int] | None = None  # (<think>, </think>) with --reasoning-parser
    thinking: bool = True  # chat_template_kwargs.enable_thinking

    @property
    def has_reasoning(self) -> bool:
        # A required or named tool_choice constrains the answer from its first token: there is
        # no reasoning to split off.
        constrained = self.tools is not None and self.tools.is_constrained
        return self.think_token_ids is not None and not constrained

    @property
    def reports_reasoning_tokens(self) -> bool:
        return self.think_token_ids is not None


class ChoiceParser:
    """One choice's answer, whole or streamed."""

    def __init__(self, parsing: AnswerParsing) -> None:
        self.parsing = parsing
        mode = parsing.tools.mode if parsing.tools is not None else "none"
        self.mode = mode if (mode != "auto" or parsing.auto_tool_parser) else "none"
        self._reasoning: ReasoningStream | None = None
        if parsing.has_reasoning:
            assert parsing.think_token_ids is not None
            start_id, end_id = parsing.think_token_ids
            self._reasoning = ReasoningStream(
                thinking=parsing.thinking, start_token_id=start_id, end_token_id=end_id
            )
        self._hermes = HermesStream() if self.mode == "auto" else None
        self._content = ""  # required/named: the JSON so far
        self._calls_sent = 0  # required: array elements sent
        self._named_id = new_call_id()
        self.num_tool_calls = 0

    @property
    def num_reasoning_tokens(self) -> int:
        return self._reasoning.num_reasoning_tokens if self._reasoning is not None else 0

    # ---- whole answers --------------------------------------------------------------------

    def message(self, text: str, token_ids: Sequence[int]) -> dict[str, Any]:
        """The assistant message of a whole answer."""
        reasoning, content = text, text
        if self._reasoning is not None:
            r1, c1 = self._reasoning.feed(text, token_ids)
            r2, c2 = self._reasoning.finish()
            reasoning, content = r1 + r2, c1 + c2
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self._reasoning is not None:
            message["content"] = content or None
            message["reasoning_content"] = message["reasoning"] = reasoning or None
        calls = self._whole_calls(content)
        if calls is not None:
            message["content"], tool_calls = calls
            message["tool_calls"] = [c.as_dict() for c in tool_calls]
            self.num_tool_calls = len(tool_calls)
        return message

    def _whole_calls(self, content: str) -> tuple[str | None, list[ToolCall]] | None:
        if self.mode == "auto":
            found, calls = parse_tool_calls(content)
            if not self.parsing.tools or self.parsing.tools.parallel_tool_calls:
                return found, calls
            return found, calls[:1]
        if self.mode == "named":
            assert self.parsing.tools is not None and self.parsing.tools.function_name
            return None, [ToolCall(self.parsing.tools.function_name, content, self._named_id)]
        if self.mode == "required":
            return None, [_required_call(item) for item in _array_items(content)]
        return None

    # ---- streamed answers -----------------------------------------------------------------

    def feed(self, text: str, token_ids: Sequence[int]) -> dict[str, Any] | None:
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text, token_ids)
        return self._delta(reasoning, *self._content_delta(content, final=False))

    def finish(self) -> dict[str, Any] | None:
        reasoning, content = "", ""
        if self._reasoning is not None:
            reasoning, content = self._reasoning.finish()
        return self._delta(reasoning, *self._content_delta(content, final=True))

    def _content_delta(self, content: str, *, final: bool) -> tuple[str, list[dict[str, Any]]]:
        if self._hermes is not None:
            text, calls = self._hermes.feed(content)
            if final:
                rest, more = self._hermes.finish()
                text, calls = text + rest, calls + more
            calls = self._limit_parallel(calls)
            self.num_tool_calls = min(self._hermes.num_calls, self._max_calls())
            return text, calls
        if self.mode == "named":
            return "", self._named_deltas(content)
        if self.mode == "required":
            return "", self._required_deltas(content)
        return content, []

    def _max_calls(self) -> int:
        tools = self.parsing.tools
        return 1 if tools is not None and not tools.parallel_tool_calls else 1 << 30

    def _limit_parallel(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [c for c in calls if c["index"] < self._max_calls()]

    def _named_deltas(self, content: str) -> list[dict[str, Any]]:
        deltas = []
        if self.num_tool_calls == 0:
            assert self.parsing.tools is not None
            name = self.parsing.tools.function_name
            head = {"name": name, "arguments": ""}
            deltas.append({"index": 0, "id": self._named_id, "type": "function", "function": head})
            self.num_tool_calls = 1
        if content:
            deltas.append({"index": 0, "function": {"arguments": content}})
        return deltas

    def _required_deltas(self, content: str) -> list[dict[str, Any]]:
        """Each array element as it completes: its name, then its arguments in one piece."""
        self._content += content
        deltas = []
        items = _array_items(self._content, complete_only=True)
        for item in items[self._calls_sent :]:
            call = _required_call(item)
            index = self._calls_sent
            head = {"name": call.name, "arguments": ""}
            deltas.append({"index": index, "id": call.id, "type": "function", "function": head})
            deltas.append({"index": index, "function": {"arguments": call.arguments}})
            self._calls_sent += 1
        self.num_tool_calls = self._calls_sent
        return deltas

    def _delta(
        self, reasoning: str, content: str, calls: list[dict[str, Any]]
    ) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta or None


def _array_items(text: str, complete_only: bool = False) -> list[Any]:
    """The elements of a JSON array of objects; a streamed one's complete elements so far."""
    if not complete_only:
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            value = None
        if isinstance(value, list):
            return value
    items = []
    pos = text.find("{")
    while pos != -1:
        end = json_value_end(text, pos)
        if end is None:
            break
        try:
            items.append(json.loads(text[pos:end]))
        except (ValueError, RecursionError):
            break
        pos = text.find("{", end)
    return items


def _required_call(item: Any) -> ToolCall:
    if not isinstance(item, dict):
        return ToolCall("", json.dumps(item, ensure_ascii=False))
    params = item.get("parameters", {})
    return ToolCall(str(item.get("name", "")), json.dumps(params, ensure_ascii=False))
