"""The Responses API's streaming events for one started request (SSE with `event:` lines).

The order, one assistant message with one text part, as OpenAI and vLLM send it:

    response.created, response.in_progress          (the Response, status in_progress)
    response.output_item.added                      (the message, status in_progress)
    response.content_part.added                     (an empty output_text part)
    response.output_text.delta ...                  (each step's new text)
    response.output_text.done                       (the whole text)
    response.content_part.done, response.output_item.done
    response.completed | response.incomplete        (the whole Response, with usage)

Every event carries `sequence_number` 0, 1, 2, ... A failure after the 200 went out is an
`error` event followed by `response.failed`. There is no `data: [DONE]` (the Responses API
has none).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from mmserve.api.chat_output import ChoiceParser
from mmserve.api.errors import as_api_error
from mmserve.api.generation import close_outputs, raise_if_failed
from mmserve.api.hermes import new_call_id
from mmserve.api.responses_output import ResponsesFormat, message_status, output_text, usage
from mmserve.engine.frontend.outputs import RequestOutput


class _Events:
    """Numbers and encodes the events of one stream."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Output:
    """The output items of one stream as they open, grow and close, with their events.

    Without tools the message opens at once (item 0). With tools (chat's parser reading the
    answer) each item opens when its first text or call arrives, in that order."""

    def __init__(self, fmt: ResponsesFormat, event: _Events) -> None:
        self.fmt = fmt
        self.event = event
        self.items: list[dict[str, Any]] = []  # by output_index: message or function_call
        self.text: list[str] = []
        self.message_index: int | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # the parser's call index -> item

    def add_text(self, delta: str) -> Iterator[str]:
        if self.message_index is None:
            self.message_index = len(self.items)
            self.items.append(self.fmt.message("", "in_progress"))
            yield self.event(
                "response.output_item.added", output_index=self.message_index, item=self.items[-1]
            )
            yield self.event("response.content_part.added", **self._part(), part=output_text(""))
        if delta:
            self.text.append(delta)
            yield self.event("response.output_text.delta", **self._part(), delta=delta, logprobs=[])

    def add_call(self, tc: dict[str, Any]) -> Iterator[str]:
        call = self.calls.get(tc.get("index", 0))
        function = tc.get("function") or {}
        if call is None:
            call_id = tc.get("id") or new_call_id()
            call = {
                "type": "function_call",
                "id": f"fc_{call_id}",
                "call_id": call_id,
                "name": function.get("name") or "",
                "arguments": "",
                "status": "in_progress",
                "output_index": len(self.items),
            }
            self.calls[tc.get("index", 0)] = call
            self.items.append(call)
            yield self.event(
                "response.output_item.added", output_index=call["output_index"], item=_item(call)
            )
        if function.get("arguments"):
            call["arguments"] += function["arguments"]
            yield self.event(
                "response.function_call_arguments.delta",
                output_index=call["output_index"],
                item_id=call["id"],
                delta=function["arguments"],
            )

    def close(self, status: str) -> Iterator[str]:
        whole = "".join(self.text)
        for index, item in enumerate(self.items):
            if index == self.message_index:
                part = self._part()
                self.items[index] = self.fmt.message(whole, status)
                yield self.event("response.output_text.done", **part, text=whole, logprobs=[])
                yield self.event("response.content_part.done", **part, part=output_text(whole))
            else:
                item["status"] = "completed"
                yield self.event(
                    "response.function_call_arguments.done",
                    output_index=index,
                    item_id=item["id"],
                    arguments=item["arguments"],
                )
            yield self.event(
                "response.output_item.done", output_index=index, item=self.output[index]
            )

    @property
    def output(self) -> list[dict[str, Any]]:
        return [_item(item) for item in self.items]

    def _part(self) -> dict[str, Any]:
        assert self.message_index is not None
        index = self.message_index
        return {"output_index": index, "item_id": self.fmt.message_id, "content_index": 0}


def _item(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k != "output_index"}


async def response_events(
    outputs: AsyncIterator[RequestOutput],
    first: RequestOutput,
    fmt: ResponsesFormat,
    include_usage: bool = True,
    n: int = 1,
) -> AsyncIterator[str]:
    """SSE events for a started request; `first` is its already-awaited first output (so that
    a failure before any token became an HTTP status). Usage is always in the last event."""
    event = _Events()
    out = _Output(fmt, event)
    parser = ChoiceParser(fmt.parsing) if fmt.parsing is not None else None
    try:
        yield event("response.created", response=fmt.snapshot("in_progress"))
        yield event("response.in_progress", response=fmt.snapshot("in_progress"))
        if parser is None:
            for line in out.add_text(""):
                yield line
        output = first
        while True:
            if output.finished or any(c.finish_reason for c in output.outputs):
                raise_if_failed(output)
            for c in output.outputs:
                if parser is None:
                    deltas = [{"content": c.delta_text}]
                else:
                    deltas = [parser.feed(c.delta_text, c.delta_token_ids or ()) or {}]
                    if c.finish_reason is not None:
                        deltas.append(parser.finish() or {})
                for delta in deltas:
                    if delta.get("content"):
                        for line in out.add_text(delta["content"]):
                            yield line
                    for tc in delta.get("tool_calls") or ():
                        for line in out.add_call(tc):
                            yield line
            if output.finished:
                break
            output = await anext(outputs)
        (choice,) = output.outputs
        status = message_status(choice.finish_reason)
        if not out.items:  # an empty answer is still one (empty) message
            for line in out.add_text(""):
                yield line
        for line in out.close(status):
            yield line
        final = fmt.snapshot(status, output=out.output, usage=usage(output, choice.num_tokens))
        yield event(f"response.{status}", response=final)
    except Exception as exc:  # reported in-band: the 200 status is already on the wire
        err = as_api_error(exc)
        yield event("error", code=err.code, message=err.message, param=err.param)
        error = {"code": err.code or "server_error", "message": err.message}
        partial = out.output
        if out.message_index is not None:
            partial[out.message_index] = fmt.message("".join(out.text), "incomplete")
        yield event("response.failed", response=fmt.snapshot("failed", output=partial, error=error))
    finally:
        await close_outputs(outputs)
