"""The qwen3 reasoning parser: `<think>...</think>` out of the answer, into reasoning_content.

As vLLM's qwen3 parser: with thinking on (the default; `chat_template_kwargs.enable_thinking:
false` turns it off) the answer starts as reasoning, whether the model writes `<think>` or the
template already opened it in the prompt; the text up to the first `</think>` is reasoning and
the rest is content. An answer that never closes its reasoning is all reasoning. Tags are
dropped: `<think>` inside reasoning and `</think>` inside content. With thinking off the answer
is content, exactly as generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmserve.api.hermes import partial_overlap

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningStream:
    """One answer's split, fed as text deltas (a whole answer is one delta, then `finish`).

    `feed` returns (reasoning delta, content delta); text that may still be a tag is held back.
    `num_reasoning_tokens` counts the generated tokens inside the reasoning, the tags left out,
    by token id (the tags are single tokens in the vocabularies this parser serves).
    """

    def __init__(self, *, thinking: bool, start_token_id: int, end_token_id: int) -> None:
        self.in_reasoning = self._thinking = thinking
        self._pending = ""
        self._start_id = start_token_id
        self._end_id = end_token_id
        self._counting = thinking
        self.num_reasoning_tokens = 0

    def feed(self, delta: str, token_ids: Sequence[int] = ()) -> tuple[str, str]:
        self._count(token_ids)
        if not self._thinking:  # thinking off: the answer is content, as written
            return "", delta
        buf = self._pending + delta
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self.in_reasoning:
                end = buf.find(THINK_END)
                start = buf.find(THINK_START)
                if start != -1 and (end == -1 or start < end):
                    reasoning.append(buf[:start])
                    buf = buf[start + len(THINK_START) :]
                    continue
                if end != -1:
                    reasoning.append(buf[:end])
                    buf = buf[end + len(THINK_END) :]
                    self.in_reasoning = False
                    continue
                keep = max(partial_overlap(buf, THINK_START), partial_overlap(buf, THINK_END))
                reasoning.append(buf[: len(buf) - keep])
            else:
                end = buf.find(THINK_END)
                if end != -1:
                    content.append(buf[:end])
                    buf = buf[end + len(THINK_END) :]
                    continue
                keep = partial_overlap(buf, THINK_END)
                content.append(buf[: len(buf) - keep])
            self._pending = buf[len(buf) - keep :]
            return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The held-back text, which no tag completed."""
        rest, self._pending = self._pending, ""
        return (rest, "") if self.in_reasoning else ("", rest)

    def _count(self, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            if not self._counting:
                return
            if token_id == self._end_id:
                self._counting = False
            elif token_id != self._start_id:
                self.num_reasoning_tokens += 1


def thinking_enabled(chat_template_kwargs: dict | None) -> bool:
    """Qwen3's switch, read as its chat template reads it."""
    return (chat_template_kwargs or {}).get("enable_thinking", True) is not False


def think_token_ids(engine: Any, reasoning_parser: str | None) -> tuple[int, int] | None:
    """(<think>, </think>) ids for --reasoning-parser qwen3 (None without the flag); a
    vocabulary without them as single tokens cannot be served with the parser."""
    if reasoning_parser is None:
        return None
    start, end = engine.token_id(THINK_START), engine.token_id(THINK_END)
    if start is None or end is None:
        raise ValueError(
            f"--reasoning-parser {reasoning_parser}: this model's vocabulary has no "
            f"{THINK_START} and {THINK_END} tokens, so its answers hold no reasoning to split; "
            "drop the flag"
        )
    return start, end
