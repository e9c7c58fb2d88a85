"""ASGI middleware that refuses request bodies over a byte cap with 413, before any parsing."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mmserve.api.errors import error_body


class BodySizeLimitMiddleware:
    """Reads the whole body (up to `max_body_bytes`) and replays it to the app.

    Content-Length is checked first so an honest oversized upload is refused without reading
    it; chunked or lying uploads are counted as they stream in. Buffering here is free: every
    route parses the whole JSON body anyway.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._refuse(send, f"{declared} bytes (Content-Length)")
            return
        chunks: list[bytes] = []
        num_bytes = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > self.max_body_bytes:
                await self._refuse(send, f"more than {self.max_body_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replay: list[Message] = [
            {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        ]

        async def replaying_receive() -> Message:
            if replay:
                return replay.pop()
            return await receive()

        await self.app(scope, replaying_receive, send)

    async def _refuse(self, send: Send, got: str) -> None:
        body = error_body(
            f"request body too large: got {got}, the limit is {self.max_body_bytes} bytes "
            "(--max-request-body-bytes). Send smaller or fewer images, or use http(s) URLs.",
            status_code=413,
            code="request_too_large",
        )
        payload = json.dumps(body).encode()
        headers: list[Any] = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload, "more_body": False})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
