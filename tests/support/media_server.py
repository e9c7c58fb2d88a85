"""One media server on 127.0.0.1 for every fetch test: files, redirects, slow and failing bodies.

Routes, in the order they are matched:

| path              | answer                                                               |
|-------------------|----------------------------------------------------------------------|
| in `redirects`    | 302 to the mapped location                                           |
| `/redirect`       | 302 to `redirect_target` (a test sets it before each fetch)          |
| `/loop`           | 302 to itself                                                        |
| in `files`        | 200 with the bytes (content type from the suffix)                    |
| `/img.png`        | 200, a 32x24 PNG                                                     |
| `/clip.mp4`       | 200, an 8-frame 32x32 MP4                                            |
| `/big`            | 200, 100,000 zero bytes                                              |
| `/late-404`       | 404 after 0.3 s                                                      |
| `/trickle`        | 200 without a length, one byte every 0.1 s, 40 bytes (~4 s)          |
| `/slow.png`       | 200 announcing 100,000 bytes, one byte every 0.25 s for up to 20 s   |
| anything else     | 404                                                                  |
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.support.factory import png_bytes, video_bytes

# /trickle sends one byte every TRICKLE_INTERVAL_S, TRICKLE_BYTES times: ~4 s in all, longer
# than the fetch timeouts the tests use, so a trickling fetch always runs into its deadline.
TRICKLE_BYTES = 40
TRICKLE_INTERVAL_S = 0.1
# /slow.png announces a body it sends one byte at a time: it holds its connection open until
# the fetcher's own timeout gives up on it.
SLOW_INTERVAL_S = 0.25
SLOW_FOR_S = 20.0
SLOW_ANNOUNCED_BYTES = 100_000

_CONTENT_TYPES = {".png": "image/png", ".mp4": "video/mp4", ".jpg": "image/jpeg"}


class MediaServer(ThreadingHTTPServer):
    """Records every path it is asked for, and how many responses are being sent right now."""

    daemon_threads = True
    request_queue_size = 64  # many fetches connect at once; the default backlog is 5

    def __init__(
        self,
        files: Mapping[str, bytes] | None = None,
        redirects: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files: dict[str, bytes] = dict(files or {})
        self.redirects: dict[str, str] = dict(redirects or {})
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
            with contextlib.suppress(OSError):  # the fetcher gave up: fine
                self._route()
        finally:
            self.server._track(-1)

    def _route(self) -> None:
        path, srv = self.path, self.server
        if path in srv.redirects:
            self._redirect(srv.redirects[path])
        elif path == "/redirect":
            self._redirect(srv.redirect_target)
        elif path == "/loop":
            self._redirect(f"{srv.base}/loop")
        elif path in srv.files:
            self._send(200, srv.files[path])
        elif path == "/img.png":
            self._send(200, png_bytes())
        elif path == "/clip.mp4":
            self._send(200, video_bytes(8, 32, 32, fps=4))
        elif path == "/big":
            self._send(200, b"\0" * 100_000)
        elif path == "/late-404":
            time.sleep(0.3)
            self._send(404, b"")
        elif path == "/trickle":
            self._trickle(TRICKLE_INTERVAL_S, TRICKLE_BYTES, None)
        elif path == "/slow.png":
            self._trickle(SLOW_INTERVAL_S, int(SLOW_FOR_S / SLOW_INTERVAL_S), SLOW_ANNOUNCED_BYTES)
        else:
            self._send(404, b"")

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        suffix = self.path[self.path.rfind(".") :] if "." in self.path else ""
        if code == 200 and suffix in _CONTENT_TYPES:
            self.send_header("Content-Type", _CONTENT_TYPES[suffix])
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _trickle(self, interval_s: float, num_bytes: int, announced_bytes: int | None) -> None:
        self.send_response(200)
        if announced_bytes is not None:
            self.send_header("Content-Length", str(announced_bytes))
        self.end_headers()
        for _ in range(num_bytes):
            self.wfile.write(b"x")
            self.wfile.flush()
            time.sleep(interval_s)


@contextlib.contextmanager
def running_media_server(
    files: Mapping[str, bytes] | None = None, redirects: Mapping[str, str] | None = None
) -> Iterator[MediaServer]:
    srv = MediaServer(files, redirects)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
