"""A media server on 127.0.0.1 for fetch tests: images, redirects, oversize and slow bodies."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.factory import random_image, video_bytes

# /trickle sends one byte every TRICKLE_INTERVAL_S, TRICKLE_BYTES times: ~4 s in all, longer
# than the fetch timeouts the tests use, so a trickling fetch always runs into its deadline.
TRICKLE_BYTES = 40
TRICKLE_INTERVAL_S = 0.1


def png_bytes(width: int = 32, height: int = 24, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    random_image(width, height, seed=seed).save(buf, format="PNG")
    return buf.getvalue()


class MediaServer(ThreadingHTTPServer):
    """Records every path it is asked for, and how many responses are being sent right now."""

    daemon_threads = True
    request_queue_size = 64  # many fetches connect at once; the default backlog is 5

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests_seen: list[str] = []
        self.redirect_target = ""
        self.active = 0
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_for_active(self, count: int, timeout_s: float = 5.0) -> int:
        """Until `count` responses are in progress at once, or timeout_s; returns how many are.

        It does not raise: a caller measures what it came to measure, then checks the count.
        """
        deadline = time.monotonic() + timeout_s
        while self.active < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.active

    def _track(self, delta: int) -> None:
        with self._lock:
            self.active += delta


class _Handler(BaseHTTPRequestHandler):
    server: MediaServer

    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.server.requests_seen.append(self.path)
        self.server._track(1)
        try:
            with contextlib.suppress(ConnectionError):  # the fetcher gave up: fine
                self._route()
        finally:
            self.server._track(-1)

    def _route(self) -> None:
        if self.path == "/img.png":
            self._send(200, png_bytes())
        elif self.path == "/clip.mp4":
            self._send(200, video_bytes(8, 32, 32, fps=4))
        elif self.path == "/redirect":
            self._redirect(self.server.redirect_target)
        elif self.path == "/loop":
            self._redirect(f"{self.server.base}/loop")
        elif self.path == "/big":
            self._send(200, b"\0" * 100_000)
        elif self.path == "/late-404":
            time.sleep(0.3)
            self._send(404, b"")
        elif self.path == "/trickle":
            self.send_response(200)
            self.end_headers()
            for _ in range(TRICKLE_BYTES):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(TRICKLE_INTERVAL_S)
        else:
            self._send(404, b"")

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()


@contextlib.contextmanager
def running_media_server() -> Iterator[MediaServer]:
    srv = MediaServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
