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
from collections.abc import AsyncIterator
from typing import Any

from mmserve.api.errors import as_api_error
from mmserve.api.generation import close_outputs, raise_if_failed
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
    item = {"output_index": 0, "item_id": fmt.message_id}
    part = {**item, "content_index": 0}
    text: list[str] = []
    opened = False
    try:
        yield event("response.created", response=fmt.snapshot("in_progress"))
        yield event("response.in_progress", response=fmt.snapshot("in_progress"))
        yield event(
            "response.output_item.added", output_index=0, item=fmt.message("", "in_progress")
        )
        yield event("response.content_part.added", **part, part=output_text(""))
        opened = True
        output = first
        while True:
            if output.finished or any(c.finish_reason for c in output.outputs):
                raise_if_failed(output)
            for c in output.outputs:
                if c.delta_text:
                    text.append(c.delta_text)
                    yield event(
                        "response.output_text.delta", **part, delta=c.delta_text, logprobs=[]
                    )
            if output.finished:
                break
            output = await anext(outputs)
        (choice,) = output.outputs
        whole = "".join(text)
        status = message_status(choice.finish_reason)
        message = fmt.message(whole, status)
        yield event("response.output_text.done", **part, text=whole, logprobs=[])
        yield event("response.content_part.done", **part, part=output_text(whole))
        yield event("response.output_item.done", output_index=0, item=message)
        final = fmt.snapshot(status, output=[message], usage=usage(output, choice.num_tokens))
        yield event(f"response.{status}", response=final)
    except Exception as exc:  # reported in-band: the 200 status is already on the wire
        err = as_api_error(exc)
        yield event("error", code=err.code, message=err.message, param=err.param)
        error = {"code": err.code or "server_error", "message": err.message}
        partial = [fmt.message("".join(text), "incomplete")] if opened else []
        yield event("response.failed", response=fmt.snapshot("failed", output=partial, error=error))
    finally:
        await close_outputs(outputs)
