"""Runs one request against the engine: limits, sampling, whole or streamed answers, disconnects."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from mmserve.api.errors import APIError, as_api_error, error_body
from mmserve.api.formats import ResponseFormat
from mmserve.api.protocol import SamplingFields
from mmserve.engine.frontend.outputs import RequestOutput
from mmserve.errors import (
    FailureKind,
    InternalRequestError,
)
from mmserve.sampling_params import SamplingParams, resolve_max_tokens

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ClientGoneError(Exception):
    """The client closed the connection before the answer was ready."""


def sampling_params_for(
    body: SamplingFields,
    requested: SamplingParams,
    prompt_len: int,
    max_model_len: int,
    *,
    default_max_tokens: int | None = None,
) -> SamplingParams:
    """`requested` (already range-checked) with max_tokens bounded by what is left of the
    model length; None becomes "up to the model length", or `default_max_tokens` (the
    checkpoint's max_new_tokens) when that is less, as in vLLM."""
    max_tokens = resolve_max_tokens(
        prompt_len,
        requested.max_tokens,
        max_model_len,
        default=default_max_tokens,
        strict=True,
        prompt_param="messages" if hasattr(body, "messages") else "prompt",
    )
    return msgspec.structs.replace(requested, max_tokens=max_tokens)


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which closes any engine iterator) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGoneError()
    return task.result()


async def collect_final(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Drain the engine's cumulative outputs; closing on any exit aborts an unfinished request."""
    last: RequestOutput | None = None
    try:
        async for output in outputs:
            last = output
            if output.finished:
                break
    finally:
        await close_outputs(outputs)
    if last is None or not last.finished:
        raise RuntimeError("the engine ended a request without a finished output")
    return last


def raise_if_failed(output: RequestOutput) -> None:
    """Raise APIError when the engine failed, aborted or dropped the request (any of its
    samples: one failing sample fails the request).

    A failure of the request's own making is a 400 that says what was wrong; one caused by a
    service being down (the remote encoder pool) a 503 that says which; any other is a 500
    that names the request id and nothing more (the engine logged the traceback).
    """
    reasons = {c.finish_reason for c in output.outputs} if output.outputs else {"error"}
    if output.error_kind is None and "error" not in reasons:
        if "abort" in reasons:
            raise APIError(
                503, "the request was aborted (the server is shutting down)", code="aborted"
            )
        return
    if output.error_kind is FailureKind.REQUEST:
        message = output.error or "the request failed inside the engine"
        raise APIError(400, message, code="request_failed", param=output.error_param)
    if output.error_kind is FailureKind.UNAVAILABLE:
        message = output.error or "a service the request needs is unavailable"
        raise APIError(503, message, code="service_unavailable")
    raise as_api_error(InternalRequestError(output.request_id))


async def stream_events(
    outputs: AsyncIterator[RequestOutput],
    first: RequestOutput,
    fmt: ResponseFormat,
    include_usage: bool,
    n: int = 1,
) -> AsyncIterator[str]:
    """SSE `data:` events for a started request, ending with `data: [DONE]`.

    One choice per chunk, `index` naming the sample; each sample's last chunk carries its
    finish_reason, and the usage chunk (summed over the samples) comes after all of them.
    `first` is the already-awaited first output, so that errors before any token became an
    HTTP status instead of an event.
    """
    num_tokens: dict[int, int] = {}
    # token ids with no text yet still go out when returned, or counted by an output parser
    counts_ids = fmt.returns_token_ids or getattr(fmt, "parsing", None) is not None
    try:
        for start in fmt.start_chunks(n):
            yield _event(start)
        output = first
        while True:
            if output.finished or any(c.finish_reason for c in output.outputs):
                raise_if_failed(output)
            for c in sorted(output.outputs, key=lambda c: c.index):
                num_tokens[c.index] = c.num_tokens
                chunk = None
                if c.finish_reason is not None:
                    chunk = fmt.chunk(c, c.finish_reason, output)
                elif c.delta_text or c.logprobs or (counts_ids and c.delta_token_ids):
                    chunk = fmt.chunk(c, None, output)  # None: a parser holds the text back
                if chunk is not None:
                    yield _event(chunk)
            if output.finished:
                if include_usage:
                    yield _event(fmt.usage_chunk(output, sum(num_tokens.values())))
                break
            output = await anext(outputs)
    except Exception as exc:  # reported in-band: the 200 status is already on the wire
        err = as_api_error(exc)
        yield _event(error_body(err.message, status_code=err.status_code, code=err.code))
    finally:
        await close_outputs(outputs)
    yield "data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def close_outputs(outputs: AsyncIterator[RequestOutput]) -> None:
    aclose = getattr(outputs, "aclose", None)
    if aclose is not None:
        # Shielded: this runs while the request task is being cancelled, and the abort must land.
        with anyio.CancelScope(shield=True):
            await aclose()


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its event generator, so a gone client aborts."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
