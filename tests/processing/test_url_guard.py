"""SSRF: a local HTTP server on 127.0.0.1 sees connections only for what the policy allows."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mmserve.errors import MediaError, MediaFetchRefusedError
from mmserve.processing.media import MediaConfig, MediaLoader
from mmserve.processing.url_guard import parse_media_url
from tests.factory import random_image


def _png() -> bytes:
    buf = io.BytesIO()
    random_image(32, 24, seed=0).save(buf, format="PNG")
    return buf.getvalue()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    requests_seen: list[str]
    redirect_target: str = ""


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.server.requests_seen.append(self.path)
        port = self.server.server_address[1]
        if self.path == "/img.png":
            self._send(200, _png())
        elif self.path == "/redirect":
            self._redirect(self.server.redirect_target)
        elif self.path == "/loop":
            self._redirect(f"http://127.0.0.1:{port}/loop")
        elif self.path == "/big":
            self._send(200, b"\0" * 100_000)
        elif self.path == "/slow":
            self.send_response(200)
            self.end_headers()
            for _ in range(40):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
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


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.requests_seen = []
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _base(srv: _Server) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def _loader(**kwargs) -> MediaLoader:
    return MediaLoader(MediaConfig(**kwargs))


def test_loopback_is_not_fetched_without_allowlisting(server: _Server) -> None:
    with pytest.raises(MediaFetchRefusedError, match="non-public"):
        _loader().load_image(f"{_base(server)}/img.png")
    port = server.server_address[1]
    with pytest.raises(MediaFetchRefusedError, match="non-public"):
        _loader().load_image(f"http://localhost:{port}/img.png")
    with pytest.raises(MediaFetchRefusedError, match="allowed-media-domains"):
        _loader(allowed_media_domains=("example.com",)).load_image(f"{_base(server)}/img.png")
    assert server.requests_seen == []


def test_allowlisted_host_is_fetched(server: _Server) -> None:
    image = _loader(allowed_media_domains=("127.0.0.1",)).load_image(f"{_base(server)}/img.png")
    assert image.size == (32, 24) and image.mode == "RGB"
    assert server.requests_seen == ["/img.png"]


def test_redirect_to_an_unlisted_host_is_refused(server: _Server) -> None:
    port = server.server_address[1]
    loader = _loader(allowed_media_domains=("127.0.0.1",))
    for target in (f"http://localhost:{port}/img.png", "http://169.254.169.254/latest/meta-data"):
        server.redirect_target = target
        with pytest.raises(MediaFetchRefusedError):
            loader.load_image(f"{_base(server)}/redirect")
    assert server.requests_seen == ["/redirect", "/redirect"]  # the targets were never hit


def test_redirect_loops_are_capped(server: _Server) -> None:
    loader = _loader(allowed_media_domains=("127.0.0.1",), max_redirects=2)
    with pytest.raises(MediaFetchRefusedError, match="redirected more than 2"):
        loader.load_image(f"{_base(server)}/loop")
    assert len(server.requests_seen) == 3


def test_byte_cap_and_timeout(server: _Server) -> None:
    loader = _loader(allowed_media_domains=("127.0.0.1",), max_fetch_bytes=10_000)
    with pytest.raises(MediaFetchRefusedError, match="10000-byte limit"):
        loader.load_image(f"{_base(server)}/big")
    slow = _loader(allowed_media_domains=("127.0.0.1",), fetch_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(MediaError, match="longer than 0.5 s"):
        slow.load_image(f"{_base(server)}/slow")
    assert time.monotonic() - start < 1.5


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://[::ffff:127.0.0.1]/img.png",
        "http://10.0.0.1/img.png",
        "http://0.0.0.0/img.png",
        "http://224.0.0.1/img.png",
    ],
)
def test_non_public_addresses_are_refused(url: str) -> None:
    with pytest.raises(MediaFetchRefusedError, match="non-public"):
        _loader().load_image(url)


def test_backslash_userinfo_and_odd_encodings_do_not_bypass_the_allowlist(server: _Server) -> None:
    port = server.server_address[1]
    loader = _loader(allowed_media_domains=("example.com",))
    tricks = [
        f"http://example.com@127.0.0.1:{port}/img.png",
        f"http://127.0.0.1:{port}\\@example.com/img.png",
        f"http://example.com\\@127.0.0.1:{port}/img.png",
        f"http://127.0.0.1%2F@example.com:{port}/img.png",
        "http://127.1/img.png",
        "http://2130706433/img.png",
        "http://0x7f000001/img.png",
        "http://ex\u0430mple.com/img.png",  # Cyrillic a
        " http://example.com/img.png",
        "gopher://example.com/",
    ]
    for url in tricks:
        with pytest.raises(MediaFetchRefusedError):
            loader.load_image(url)
    assert server.requests_seen == []


def test_file_urls_need_the_allowed_path(tmp_path) -> None:
    with pytest.raises(MediaFetchRefusedError, match="allowed-local-media-path"):
        _loader().load_image("file:///etc/passwd")
    allowed = tmp_path / "media"
    allowed.mkdir()
    random_image(10, 10).save(allowed / "ok.png")
    (allowed / "escape.png").symlink_to("/etc/passwd")
    loader = _loader(allowed_local_media_path=str(allowed))
    assert loader.load_image(f"file://{allowed}/ok.png").size == (10, 10)
    for url in (
        "file:///etc/passwd",
        f"file://{allowed}/../../../etc/passwd",
        f"file://{allowed}/escape.png",
        f"file://{allowed}/%2e%2e/%2e%2e/etc/passwd",
        f"file://{allowed}\\..\\x.png",
        f"file://otherhost{allowed}/ok.png",
    ):
        with pytest.raises(MediaError):
            loader.load_image(url)


def test_parsed_url_keeps_host_and_port_for_the_host_header() -> None:
    parsed = parse_media_url("https://Example.com:8443/a/b.png?x=1#frag")
    assert (parsed.host, parsed.port, parsed.target) == ("example.com", 8443, "/a/b.png?x=1")
    assert parsed.host_header == "example.com:8443"
