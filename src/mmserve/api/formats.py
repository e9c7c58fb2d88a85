"""The JSON shapes of chat and text completions: whole responses, stream chunks and usage.

One choice per sample (`index` 0..n-1); a stream chunk carries one choice. Logprobs take
vLLM's (and OpenAI's) shapes: chat `logprobs.content = [{token, logprob, bytes,
top_logprobs}]`, completions `logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`.
vLLM's extensions: `prompt_logprobs` (`[null, {"<id>": {logprob, rank, decoded_token}}, ...]`,
on the chat response and on each completion choice) and, with `return_token_ids`,
`prompt_token_ids` (the chat response or the first chunk; each completion choice or its first
chunk) and `token_ids` (each choice; a chunk's new ones).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mmserve.api.chat_output import AnswerParsing, ChoiceParser
from mmserve.engine.frontend.outputs import CompletionOutput, RequestOutput, TokenLogprobs

# JSON has no -inf: a prompt token of probability 0 is reported as this (vLLM's value)
_MIN_LOGPROB = -9999.0


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

    def __init__(
        self,
        request_id: str,
        model: str,
        *,
        num_top_logprobs: int = 0,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """`prompt_token_ids`: given when the request asked `return_token_ids`."""
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.num_top_logprobs = num_top_logprobs
        self.prompt_token_ids = prompt_token_ids

    @property
    def returns_token_ids(self) -> bool:
        return self.prompt_token_ids is not None

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
        body["usage"] = self._usage(output, completion_tokens)
        return body

    def _usage(self, output: RequestOutput, completion_tokens: int | None = None) -> dict:
        return usage_of(output, completion_tokens)


class ChatFormat(_Format):
    """`chat.completion` and `chat.completion.chunk` objects for one request; `role` is the
    answer's (vLLM's: the last message's when the request has no generation prompt)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self,
        request_id: str,
        model: str,
        *,
        num_top_logprobs: int = 0,
        prompt_token_ids: list[int] | None = None,
        role: str = "assistant",
        parsing: AnswerParsing | None = None,
    ) -> None:
        super().__init__(
            request_id, model, num_top_logprobs=num_top_logprobs, prompt_token_ids=prompt_token_ids
        )
        self.role = role
        self.parsing = parsing  # reasoning and tool calls to read out of the text
        self._parsers: dict[int, ChoiceParser] = {}  # per choice

    def response(self, output: RequestOutput) -> dict[str, Any]:
        choices = []
        for c in _sorted(output):
            message: dict[str, Any] = {"role": self.role, "content": c.text}
            if self.parsing is not None:
                message = {**self._parser(c.index).message(c.text, c.token_ids), "role": self.role}
            choice = {
                "index": c.index,
                "message": message,
                "finish_reason": self._finish_reason(c.index, c.finish_reason),
                "logprobs": self._logprobs(c),
            }
            if self.returns_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        body = self._envelope(self.object_name, choices)
        body["usage"] = self._usage(output)
        if output.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
        if self.returns_token_ids:
            body["prompt_token_ids"] = self.prompt_token_ids
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
        chunks = [
            self._envelope(
                self.chunk_object_name,
                [
                    {
                        "index": i,
                        "delta": {"role": self.role, "content": ""},
                        "finish_reason": None,
                        "logprobs": None,
                    }
                ],
            )
            for i in range(n)
        ]
        if self.returns_token_ids and chunks:
            chunks[0]["prompt_token_ids"] = self.prompt_token_ids
        return chunks

    def chunk(
        self, c: CompletionOutput, finish_reason: str | None, output: RequestOutput | None = None
    ) -> dict[str, Any] | None:
        """One choice's chunk; None when a parser holds this step's text back (it may be the
        start of a tag) and there is nothing else to send."""
        logprobs = self._logprobs(c)
        if self.parsing is None:
            text = c.delta_text
            delta: dict[str, Any] = {"content": text} if text or finish_reason is None else {}
        else:
            delta = self._parsed_delta(c, finish_reason is not None)
            sends_ids = self.returns_token_ids and bool(c.delta_token_ids)
            if not delta and finish_reason is None and logprobs is None and not sends_ids:
                return None
            finish_reason = self._finish_reason(c.index, finish_reason)
        choice = {
            "index": c.index,
            "delta": delta,
            "finish_reason": finish_reason,
            "logprobs": logprobs,
        }
        if self.returns_token_ids:
            choice["token_ids"] = list(c.delta_token_ids or [])
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
    """`text_completion` objects (whole and streamed) for one request. With `echo`, each choice
    starts with `prompt_text` (and its logprobs with the prompt's, the first token's null);
    `decode` gives a token's text where no logprob entry carries it (the prompt's first)."""

    object_name = chunk_object_name = "text_completion"

    def __init__(
        self,
        request_id: str,
        model: str,
        *,
        num_top_logprobs: int = 0,
        prompt_token_ids: list[int] | None = None,
        echo_prompt: tuple[str, list[int]] | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        """`echo_prompt`: the prompt's text and ids when the request asked `echo`."""
        super().__init__(
            request_id, model, num_top_logprobs=num_top_logprobs, prompt_token_ids=prompt_token_ids
        )
        self.echo_prompt = echo_prompt
        self._decode = decode or (lambda ids: "")
        self._text_offsets: dict[int, int] = {}  # per choice: characters streamed so far
        self._started: set[int] = set()  # choices whose first chunk is sent (stream)
        self._prompt_logprobs: list[TokenLogprobs | None] | None = None

    def response(self, output: RequestOutput) -> dict[str, Any]:
        choices = [
            self._choice(c, output, c.text, c.token_ids, c.logprobs) for c in _sorted(output)
        ]
        body = self._envelope(self.object_name, choices)
        body["usage"] = usage_of(output)
        return body

    def start_chunks(self, n: int) -> list[dict[str, Any]]:
        return []

    def chunk(
        self, c: CompletionOutput, finish_reason: str | None, output: RequestOutput | None = None
    ) -> dict[str, Any]:
        is_first = c.index not in self._started
        self._started.add(c.index)
        choice = self._choice(
            c,
            output,
            c.delta_text,
            c.delta_token_ids or [],
            c.logprobs,
            is_first=is_first,
        )
        choice["finish_reason"] = finish_reason
        return self._envelope(self.object_name, [choice])

    def _choice(
        self,
        c: CompletionOutput,
        output: RequestOutput | None,
        text: str,
        token_ids: Sequence[int],
        entries: Sequence[TokenLogprobs] | None,
        *,
        is_first: bool = True,
    ) -> dict[str, Any]:
        if output is not None and output.prompt_logprobs is not None:
            self._prompt_logprobs = output.prompt_logprobs
        shown_ids: list[int] = list(token_ids)
        shown: list[TokenLogprobs | None] | None = None if entries is None else list(entries)
        if self.echo_prompt is not None and is_first:
            prompt_text, prompt_ids = self.echo_prompt
            text = prompt_text + text
            shown_ids = prompt_ids + shown_ids
            if shown is not None:
                shown = list(self._prompt_logprobs or [None] * len(prompt_ids)) + shown
        choice: dict[str, Any] = {
            "index": c.index,
            "text": text,
            "finish_reason": c.finish_reason,
            "logprobs": None if shown is None else self._logprobs(c.index, shown_ids, shown),
        }
        if self._prompt_logprobs is not None and is_first:
            choice["prompt_logprobs"] = prompt_logprobs_json(self._prompt_logprobs)
        if self.returns_token_ids:
            if is_first:
                choice["prompt_token_ids"] = self.prompt_token_ids
            choice["token_ids"] = list(token_ids)
        return choice

    def _logprobs(
        self, index: int, token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None]
    ) -> dict[str, Any]:
        offset = self._text_offsets.get(index, 0)
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[Mapping[str, float] | None] = []
        text_offset: list[int] = []
        for token_id, entry in zip(token_ids, entries, strict=True):
            if entry is None:  # the prompt's first token: no logits before it
                token = self._decode([token_id])
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                chosen = entry[token_id]
                token = chosen.decoded_token
                token_logprobs.append(max(chosen.logprob, _MIN_LOGPROB))
                top_logprobs.append(_top_by_text(entry))
            tokens.append(token)
            text_offset.append(offset)
            offset += len(token)
        self._text_offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }


def prompt_logprobs_json(entries: Sequence[TokenLogprobs | None]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token null (the first) or {"<token id>": {logprob,
    rank, decoded_token}}."""
    return [
        None
        if entry is None
        else {
            str(token_id): {
                "logprob": max(lp.logprob, _MIN_LOGPROB),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]


def _top_by_text(entry: TokenLogprobs) -> Mapping[str, float]:
    """{token text: logprob} of the sampled token and the top K, most likely first."""
    ranked = sorted(entry.values(), key=lambda v: v.rank)
    return {lp.decoded_token: max(lp.logprob, _MIN_LOGPROB) for lp in ranked}


ResponseFormat = ChatFormat | CompletionFormat
