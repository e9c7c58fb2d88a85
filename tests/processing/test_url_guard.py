"""SSRF: a local HTTP server on 127.0.0.1 sees connections only for what the policy allows.

Every rule is checked through both fetch paths: the blocking one (offline API) and the
event-loop one (the server).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
from PIL import Image

from mmserve.config.allowlist import AllowedHost, parse_allowed_host
from mmserve.config.media import MediaConfig
from mmserve.errors import MediaError, MediaFetchRefusedError
from mmserve.processing.media import MediaLoader, MediaSource
from mmserve.processing.url_guard import parse_media_url
from tests.support.media_server import MediaServer, running_media_server

Load = Callable[[MediaLoader, MediaSource], Image.Image]


@pytest.fixture
def server() -> Iterator[MediaServer]:
    with running_media_server() as srv:
        yield srv


@pytest.fixture(params=["sync", "async"])
def load(request: pytest.FixtureRequest) -> Load:
    if request.param == "sync":
        return lambda loader, source: loader.load_image(source)
    return lambda loader, source: asyncio.run(loader.aload_image(source))


def _loader(**kwargs) -> MediaLoader:
    return MediaLoader(MediaConfig(**kwargs))


def _listed(srv: MediaServer) -> tuple[str, ...]:
    return (f"127.0.0.1:{srv.port}",)


def test_loopback_is_not_fetched_without_allowlisting(server: MediaServer, load: Load) -> None:
    with pytest.raises(MediaFetchRefusedError, match="non-public"):
        load(_loader(), f"{server.base}/img.png")
    with pytest.raises(MediaFetchRefusedError, match="non-public"):
        load(_loader(), f"http://localhost:{server.port}/img.png")
    with pytest.raises(MediaFetchRefusedError, match="allowed-media-domains"):
        load(_loader(allowed_media_domains=("example.com",)), f"{server.base}/img.png")
    assert server.requests_seen == []


def test_allowlisted_host_and_port_is_fetched(server: MediaServer, load: Load) -> None:
    image = load(_loader(allowed_media_domains=_listed(server)), f"{server.base}/img.png")
    assert image.size == (32, 24) and image.mode == "RGB"
    assert server.requests_seen == ["/img.png"]


def test_a_bare_host_allows_only_the_default_port(server: MediaServer, load: Load) -> None:
    loader = _loader(allowed_media_domains=("127.0.0.1",))
    with pytest.raises(MediaFetchRefusedError, match=f"port {server.port} is not allowed") as e:
        load(loader, f"{server.base}/img.png")
    assert f"'127.0.0.1:{server.port}'" in e.value.message  # says what to list instead
    other = _loader(allowed_media_domains=(f"127.0.0.1:{server.port + 1}",))
    with pytest.raises(MediaFetchRefusedError, match=f"port {server.port} is not allowed"):
        load(other, f"{server.base}/img.png")
    assert server.requests_seen == []


def test_redirect_to_an_unlisted_host_or_port_is_refused(server: MediaServer, load: Load) -> None:
    loader = _loader(allowed_media_domains=_listed(server))
    targets = [
        f"http://localhost:{server.port}/img.png",
        "http://169.254.169.254/latest/meta-data",
        f"http://127.0.0.1:{server.port + 1}/img.png",
        "http://127.0.0.1/img.png",
    ]
    for target in targets:
        server.redirect_target = target
        with pytest.raises(MediaFetchRefusedError):
            load(loader, f"{server.base}/redirect")
    assert server.requests_seen == ["/redirect"] * len(targets)  # no target was ever hit
    server.redirect_target = f"{server.base}/img.png"
    assert load(loader, f"{server.base}/redirect").size == (32, 24)


def test_redirect_loops_are_capped(server: MediaServer, load: Load) -> None:
    loader = _loader(allowed_media_domains=_listed(server), max_redirects=2)
    with pytest.raises(MediaFetchRefusedError, match="redirected more than 2"):
        load(loader, f"{server.base}/loop")
    assert len(server.requests_seen) == 3


def test_byte_cap_and_timeout(server: MediaServer, load: Load) -> None:
    loader = _loader(allowed_media_domains=_listed(server), max_media_bytes=10_000)
    with pytest.raises(MediaFetchRefusedError, match="10000-byte limit"):
        load(loader, f"{server.base}/big")
    slow = _loader(allowed_media_domains=_listed(server), media_fetch_timeout=0.5)
    start = time.monotonic()
    with pytest.raises(MediaError, match="longer than 0.5 s"):
        load(slow, f"{server.base}/trickle")
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
def test_non_public_addresses_are_refused(url: str, load: Load) -> None:
    with pytest.raises(MediaFetchRefusedError, match="non-public"):
        load(_loader(), url)


def test_backslash_userinfo_and_odd_encodings_do_not_bypass_the_allowlist(
    server: MediaServer, load: Load
) -> None:
    port = server.port
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
            load(loader, url)
    assert server.requests_seen == []


def test_parsed_url_keeps_host_and_port_for_the_host_header() -> None:
    parsed = parse_media_url("https://Example.com:8443/a/b.png?x=1#frag")
    assert (parsed.host, parsed.port, parsed.target) == ("example.com", 8443, "/a/b.png?x=1")
    assert parsed.host_header == "example.com:8443"


@pytest.mark.parametrize(
    ("entry", "host", "port"),
    [
        ("Example.COM", "example.com", None),
        ("example.com:8080", "example.com", 8080),
        ("10.0.0.5:9000", "10.0.0.5", 9000),
        ("[::1]:9000", "::1", 9000),
        ("[::1]", "::1", None),
        ("::1", "::1", None),
    ],
)
def test_allowlist_entries_parse(entry: str, host: str, port: int | None) -> None:
    assert parse_allowed_host(entry) == AllowedHost(host, port)


@pytest.mark.parametrize(
    "entry", ["", "example.com:", "example.com:0", "example.com:http", "[::1", "[::1]x", "127.1"]
)
def test_bad_allowlist_entries_are_refused_at_start(entry: str) -> None:
    with pytest.raises(ValueError, match="--allowed-media-domains entry"):
        parse_allowed_host(entry)
    with pytest.raises(ValueError, match="--allowed-media-domains entry"):
        MediaConfig(allowed_media_domains=("ok.example", entry or ":"))


def test_a_bare_host_means_each_schemes_default_port() -> None:
    entry = parse_allowed_host("example.com")
    assert entry.allows(parse_media_url("http://example.com/x.png"))
    assert entry.allows(parse_media_url("https://example.com/x.png"))
    assert not entry.allows(parse_media_url("https://example.com:80/x.png"))
    assert not entry.allows(parse_media_url("http://example.com:8080/x.png"))
    assert parse_allowed_host("example.com:443").allows(parse_media_url("https://example.com/"))
