"""The JSON shapes of chat and text completions: whole responses, stream chunks and usage.

One choice per sample (`index` 0..n-1); a stream chunk carries one choice. Logprobs take
vLLM's (and OpenAI's) shapes: chat `logprobs.content = [{token, logprob, bytes,
top_logprobs}]`, completions `logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from mmserve.api.chat_output import AnswerParsing, ChoiceParser
from mmserve.engine.frontend.outputs import CompletionOutput, RequestOutput, TokenLogprobs


def usage_of(output: RequestOutput, completion_tokens: int | None = None) -> dict[str, Any]:
    """Exact token counts: the prompt as the model saw it (placeholders expanded) and the
    outputs, summed over the choices (`completion_tokens` when the caller counted them)."""
    prompt_tokens = len(output.prompt_token_ids)
    if completion_tokens is None:
        completion_tokens = sum(c.num_tokens for c in output.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
    }


def _sorted(output: RequestOutput) -> list[CompletionOutput]:
    return sorted(output.outputs, key=lambda c: c.index)


class _Format:
    """What both endpoints share: the envelope and the usage chunk."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, *, num_top_logprobs: int = 0) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.num_top_logprobs = num_top_logprobs

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage_chunk(self, output: RequestOutput, completion_tokens: int) -> dict[str, Any]:
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = usage_of(output, completion_tokens)
        return body


class ChatFormat(_Format):
    """`chat.completion` and `chat.completion.chunk` objects for one request."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self,
        request_id: str,
        model: str,
        *,
        num_top_logprobs: int = 0,
        parsing: AnswerParsing | None = None,
    ) -> None:
        super().__init__(request_id, model, num_top_logprobs=num_top_logprobs)
        self.parsing = parsing  # reasoning and tool calls to read out of the text
        self._parsers: dict[int, ChoiceParser] = {}  # per choice

    def response(self, output: RequestOutput) -> dict[str, Any]:
        choices = []
        for c in _sorted(output):
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            if self.parsing is not None:
                message = self._parser(c.index).message(c.text, c.token_ids)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "finish_reason": self._finish_reason(c.index, c.finish_reason),
                    "logprobs": self._logprobs(c),
                }
            )
        body = self._envelope(self.object_name, choices)
        body["usage"] = self._usage(output)
        return body

    def usage_chunk(self, output: RequestOutput, completion_tokens: int) -> dict[str, Any]:
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = self._usage(output, completion_tokens)
        return body

    def _usage(self, output: RequestOutput, completion_tokens: int | None = None) -> dict:
        usage = usage_of(output, completion_tokens)
        if self.parsing is not None and self.parsing.reports_reasoning_tokens:
            # completion_tokens include them, as in vLLM and OpenAI
            reasoning = sum(p.num_reasoning_tokens for p in self._parsers.values())
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage

    def _parser(self, index: int) -> ChoiceParser:
        assert self.parsing is not None
        if index not in self._parsers:
            self._parsers[index] = ChoiceParser(self.parsing)
        return self._parsers[index]

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        """The engine's reason, with "stop" read as "tool_calls" when an auto or required
        tool_choice ended in calls (a named one stays "stop", as in OpenAI and vLLM)."""
        parser = self._parsers.get(index)
        if reason == "stop" and parser is not None and parser.mode in ("auto", "required"):
            return "tool_calls" if parser.num_tool_calls else reason
        return reason

    def start_chunks(self, n: int) -> list[dict[str, Any]]:
        return [
            self._envelope(
                self.chunk_object_name,
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                        "logprobs": None,
                    }
                ],
            )
            for i in range(n)
        ]

    def chunk(self, c: CompletionOutput, finish_reason: str | None) -> dict[str, Any] | None:
        """One choice's chunk; None when a parser holds this step's text back (it may be the
        start of a tag) and there is nothing else to send."""
        logprobs = self._logprobs(c)
        if self.parsing is None:
            text = c.delta_text
            delta: dict[str, Any] = {"content": text} if text or finish_reason is None else {}
        else:
            delta = self._parsed_delta(c, finish_reason is not None)
            if not delta and finish_reason is None and logprobs is None:
                return None
            finish_reason = self._finish_reason(c.index, finish_reason)
        choice = {
            "index": c.index,
            "delta": delta,
            "finish_reason": finish_reason,
            "logprobs": logprobs,
        }
        return self._envelope(self.chunk_object_name, [choice])

    def _parsed_delta(self, c: CompletionOutput, is_last: bool) -> dict[str, Any]:
        parser = self._parser(c.index)
        delta = parser.feed(c.delta_text, c.delta_token_ids or ()) or {}
        if is_last:
            for key, value in (parser.finish() or {}).items():
                delta[key] = delta.get(key, type(value)()) + value
        return delta

    def _logprobs(self, c: CompletionOutput) -> dict[str, Any] | None:
        if c.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(c.token_ids, c.logprobs, strict=True):
            chosen = entry[token_id]
            top = sorted(entry.values(), key=lambda lp: lp.rank)[: self.num_top_logprobs]
            item = _chat_token(chosen.decoded_token, chosen.logprob)
            item["top_logprobs"] = [_chat_token(lp.decoded_token, lp.logprob) for lp in top]
            content.append(item)
        return {"content": content}


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


class CompletionFormat(_Format):
    """`text_completion` objects (whole and streamed) for one request."""

    object_name = chunk_object_name = "text_completion"

    def __init__(self, request_id: str, model: str, *, num_top_logprobs: int = 0) -> None:
        super().__init__(request_id, model, num_top_logprobs=num_top_logprobs)
        self._text_offsets: dict[int, int] = {}  # per choice: characters streamed so far

    def response(self, output: RequestOutput) -> dict[str, Any]:
        choices = [
            {
                "index": c.index,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": self._logprobs(c),
            }
            for c in _sorted(output)
        ]
        body = self._envelope(self.object_name, choices)
        body["usage"] = usage_of(output)
        return body

    def start_chunks(self, n: int) -> list[dict[str, Any]]:
        return []

    def chunk(self, c: CompletionOutput, finish_reason: str | None) -> dict[str, Any]:
        choice = {
            "index": c.index,
            "text": c.delta_text,
            "finish_reason": finish_reason,
            "logprobs": self._logprobs(c),
        }
        return self._envelope(self.object_name, [choice])

    def _logprobs(self, c: CompletionOutput) -> dict[str, Any] | None:
        if c.logprobs is None:
            return None
        offset = self._text_offsets.get(c.index, 0)
        tokens: list[str] = []
        token_logprobs: list[float] = []
        top_logprobs: list[dict[str, float]] = []
        text_offset: list[int] = []
        for token_id, entry in zip(c.token_ids, c.logprobs, strict=True):
            chosen = entry[token_id]
            tokens.append(chosen.decoded_token)
            token_logprobs.append(chosen.logprob)
            top_logprobs.append(_top_by_text(entry))
            text_offset.append(offset)
            offset += len(chosen.decoded_token)
        self._text_offsets[c.index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }


def _top_by_text(entry: TokenLogprobs) -> Mapping[str, float]:
    """{token text: logprob} of the sampled token and the top K, most likely first."""
    return {lp.decoded_token: lp.logprob for lp in sorted(entry.values(), key=lambda v: v.rank)}


ResponseFormat = ChatFormat | CompletionFormat
