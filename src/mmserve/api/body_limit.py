"""ASGI middleware for the request body contract: JSON (415), at most N bytes (413), all of it
within a deadline (408), each decided before any parsing."""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mmserve.api.errors import send_error

_BODYLESS_METHODS = ("GET", "HEAD", "OPTIONS")


class RequestBodyMiddleware:
    """Checks Content-Type, reads the whole body (up to `max_body_bytes`) and replays it.

    Only `application/json` is accepted: a web page can POST text/plain, form or multipart
    bodies to a local server cross-origin without a CORS preflight, so refusing them here
    closes that door. Content-Length is checked next so an honest oversized upload is refused
    without reading it; chunked or lying uploads are counted as they stream in. The whole body
    must arrive within `body_timeout_s` of the headers (a deadline, not an idle timeout: a
    trickle of bytes does not extend it). Buffering here is free: every route parses the whole
    JSON body anyway.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _BODYLESS_METHODS:
            await self.app(scope, receive, send)
            return
        content_type = _header(scope, b"content-type")
        refusal = _content_type_refusal(content_type)
        if refusal is not None:
            await send_error(
                send, refusal, status_code=415, code="unsupported_media_type", param="Content-Type"
            )
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._too_large(send, f"{declared} bytes (Content-Length)")
            return
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read_body(receive)
        except TimeoutError:
            await send_error(
                send,
                f"the request body did not arrive within {self.body_timeout_s:g} s of its "
                "headers (--http-body-timeout); send it in one go",
                status_code=408,
                code="request_timeout",
            )
            return
        if body is None:  # the client left
            return
        if len(body) > self.max_body_bytes:
            await self._too_large(send, f"more than {self.max_body_bytes} bytes")
            return
        replay: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

        async def replaying_receive() -> Message:
            if replay:
                return replay.pop()
            return await receive()

        await self.app(scope, replaying_receive, send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body; stops early (returning what is over the cap) once it is too big."""
        chunks: list[bytes] = []
        num_bytes = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            chunks.append(chunk)
            if num_bytes > self.max_body_bytes or not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send: Send, got: str) -> None:
        await send_error(
            send,
            f"request body too large: got {got}, the limit is {self.max_body_bytes} bytes "
            "(--max-request-body-bytes). Send smaller or fewer images, or use http(s) URLs.",
            status_code=413,
            code="request_too_large",
        )


def _content_type_refusal(value: bytes | None) -> str | None:
    """Why this Content-Type is refused, or None for application/json (any case, UTF-8)."""
    fix = "send the body as JSON with 'Content-Type: application/json'"
    if value is None:
        return f"the request has no Content-Type header; {fix}"
    text = value.decode("latin-1")
    media_type, *params = (p.strip() for p in text.split(";"))
    if media_type.lower() != "application/json":
        return f"Content-Type {text[:100]!r} is not supported; {fix}"
    for param in params:
        name, _, charset = param.partition("=")
        if name.strip().lower() == "charset" and charset.strip().strip('"').lower() not in (
            "utf-8",
            "utf8",
        ):
            return (
                f"Content-Type charset {charset.strip()[:40]!r} is not supported; send UTF-8 "
                "JSON as 'Content-Type: application/json'"
            )
    return None


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None
