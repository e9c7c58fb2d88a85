"""uvicorn's h11 protocol with a header deadline, so a connection cannot be held open forever.

uvicorn alone has only the keep-alive idle timer, which it cancels at the first byte and
re-arms only after a response: a client that connects and sends nothing, or one header byte a
minute, holds its connection (and a file descriptor) forever. Here each request's headers must
be complete within `header_timeout_s` of the connection opening or of the previous response.
It is a deadline, not an idle timer: a trickle of bytes does not extend it.

    connection opens / response sent          headers complete            body read
    |---- header deadline (this module) ----->|---- body deadline -------->|
    |-- keep-alive idle (uvicorn, to 1st byte)       (RequestBodyMiddleware)
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from mmserve.api.errors import error_body


class HeaderDeadlineH11Protocol(H11Protocol):
    """H11Protocol whose connections must deliver complete request headers in time."""

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._header_deadline: asyncio.TimerHandle | None = None
        self._has_partial_request = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._has_partial_request = True
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # h11 parsed a new request's headers: the deadline is met
            self._cancel_header_deadline()

    def on_response_complete(self) -> None:
        # Armed before uvicorn starts a pipelined request (which cancels it again in
        # handle_events), so the next request's headers are on the clock from now.
        if not self.transport.is_closing():
            self._arm_header_deadline()
        super().on_response_complete()

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self._has_partial_request = False
        self._header_deadline = self.loop.call_later(
            self.header_timeout_s, self._on_header_deadline
        )

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _on_header_deadline(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered; its headers were in time
        if self._has_partial_request:
            # Partial headers: say why before closing. Written raw, because h11 will not
            # send a response to a request it has not parsed.
            self.transport.write(_timeout_response(self.header_timeout_s))
        self.transport.close()


def header_deadline_protocol(header_timeout_s: float) -> Callable[..., HeaderDeadlineH11Protocol]:
    """What uvicorn.Config(http=...) takes: it calls this with its own arguments per connection."""
    return functools.partial(HeaderDeadlineH11Protocol, header_timeout_s=header_timeout_s)


def _timeout_response(header_timeout_s: float) -> bytes:
    body = error_body(
        f"the request headers did not arrive within {header_timeout_s:g} s "
        "(--http-header-timeout); send the whole request at once",
        status_code=408,
        code="request_timeout",
    )
    payload = json.dumps(body).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + payload
