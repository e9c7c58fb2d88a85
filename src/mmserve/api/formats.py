"""The JSON shapes of chat and text completions: whole responses, stream chunks and usage."""

from __future__ import annotations

import time
from typing import Any

from mmserve.engine.outputs import RequestOutput


def usage_of(output: RequestOutput) -> dict[str, Any]:
    """Exact token counts: the prompt as the model saw it (placeholders expanded) and the output."""
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = output.outputs[0].num_tokens if output.outputs else 0
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
    }


class ChatFormat:
    """`chat.completion` and `chat.completion.chunk` objects for one request."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def response(self, output: RequestOutput, finish_reason: str) -> dict[str, Any]:
        message = {"role": "assistant", "content": output.outputs[0].text}
        choice = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
        body = self._envelope("chat.completion", [choice])
        body["usage"] = usage_of(output)
        return body

    def start_chunk(self) -> dict[str, Any] | None:
        delta = {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}
        return self._envelope("chat.completion.chunk", [choice])

    def chunk(self, delta_text: str, finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": delta_text} if delta_text or finish_reason is None else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return self._envelope("chat.completion.chunk", [choice])

    def usage_chunk(self, output: RequestOutput) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk", [])
        body["usage"] = usage_of(output)
        return body


class CompletionFormat:
    """`text_completion` objects (whole and streamed) for one request."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def response(self, output: RequestOutput, finish_reason: str) -> dict[str, Any]:
        text = output.outputs[0].text
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        body = self._envelope([choice])
        body["usage"] = usage_of(output)
        return body

    def start_chunk(self) -> dict[str, Any] | None:
        return None

    def chunk(self, delta_text: str, finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": delta_text, "finish_reason": finish_reason, "logprobs": None}
        return self._envelope([choice])

    def usage_chunk(self, output: RequestOutput) -> dict[str, Any]:
        body = self._envelope([])
        body["usage"] = usage_of(output)
        return body


ResponseFormat = ChatFormat | CompletionFormat
