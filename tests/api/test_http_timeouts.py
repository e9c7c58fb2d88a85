"""HTTP server timeouts and refusals before the body, over raw sockets to a real server process.

Short timeouts (header 2 s, body 1 s, keep-alive 0.5 s) keep this quick; the echo engine
takes 50 ms per token, so a 60-token answer outlives the header timeout. Upper bounds leave
seconds of slack for a loaded machine, and each is still below what a missing timeout gives.
"""

from __future__ import annotations

import json
import select
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.echo_server import EchoServer, read_until_closed

HEADER_S, BODY_S, KEEP_ALIVE_S = 2.0, 1.0, 0.5
SLACK_S = 2.0
TIMEOUT_FLAGS = (
    "--http-header-timeout", str(HEADER_S),
    "--http-body-timeout", str(BODY_S),
    "--http-keep-alive-timeout", str(KEEP_ALIVE_S),
)  # fmt: skip
CHAT = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EchoServer]:
    with EchoServer(tmp_path_factory.mktemp("timeouts"), *TIMEOUT_FLAGS) as s:
        yield s


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EchoServer]:
    tmp = tmp_path_factory.mktemp("keyed")
    with EchoServer(tmp, *TIMEOUT_FLAGS, "--api-key", "s3cret") as s:
        yield s


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def json_of(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


def test_a_silent_connection_is_closed_at_the_header_deadline(server: EchoServer) -> None:
    with server.connect() as sock:
        data, closed_after = read_until_closed(sock, timeout_s=HEADER_S + 5)
    assert data == b""  # nothing was asked, so nothing is answered
    assert HEADER_S - 0.2 < closed_after < HEADER_S + SLACK_S


def test_trickled_headers_do_not_extend_the_deadline(server: EchoServer) -> None:
    start = time.monotonic()
    with server.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        # One header line every 0.2 s for 6 s: an idle timer would never fire. Stop once the
        # server speaks (writing after its close would reset the connection, losing the 408).
        for i in range(30):
            readable, _, _ = select.select([sock], [], [], 0.2)
            if readable:
                break
            sock.sendall(b"x-slow-%d: 1\r\n" % i)
        data, _ = read_until_closed(sock, timeout_s=5)
    assert status_of(data) == 408
    assert json_of(data)["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < HEADER_S + SLACK_S  # < 6 s: the trickle did not help


def test_a_body_that_never_completes_gets_408(server: EchoServer) -> None:
    start = time.monotonic()
    with server.connect() as sock:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
        )
        sock.sendall(head + b'{"messages": ')
        data, _ = read_until_closed(sock, timeout_s=BODY_S + 5)
    assert status_of(data) == 408
    error = json_of(data)["error"]
    assert error["code"] == "request_timeout" and "--http-body-timeout" in error["message"]
    assert BODY_S - 0.2 < time.monotonic() - start < BODY_S + SLACK_S


def test_an_idle_keep_alive_connection_is_closed(server: EchoServer) -> None:
    with server.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        data, closed_after = read_until_closed(sock, timeout_s=KEEP_ALIVE_S + 5)
    assert status_of(data) == 200
    assert closed_after < HEADER_S - 0.3  # the idle timer, not the header deadline, closed it


def test_keep_alive_serves_several_requests_on_one_connection(server: EchoServer) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for _ in range(3):
            assert client.get("/health").status_code == 200
            time.sleep(KEEP_ALIVE_S / 3)
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_a_long_answer_outlives_the_header_timeout(server: EchoServer) -> None:
    body = {**CHAT, "max_tokens": 60}  # 60 tokens at 50 ms: 3 s
    start = time.monotonic()
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=20)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 60
    assert time.monotonic() - start > HEADER_S


def test_many_half_open_connections_are_all_closed_and_others_served(server: EchoServer) -> None:
    socks = [server.connect() for _ in range(50)]
    try:
        for i, sock in enumerate(socks):
            if i % 2:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
        # The server still answers others while they hang.
        assert httpx.post(f"{server.url}/v1/chat/completions", json=CHAT).status_code == 200
        closed = 0
        for sock in socks:
            read_until_closed(sock, timeout_s=HEADER_S + 5)
            closed += 1
        assert closed == len(socks)
    finally:
        for sock in socks:
            sock.close()


def _send_without_body(
    server: EchoServer, headers: bytes, num_bytes: int = 50_000_000
) -> tuple[bytes, float]:
    """Headers announcing a body (50 MB, under the cap), none of which is sent: the answer
    must come at once, not at the body deadline."""
    with server.connect() as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            + b"content-length: %d\r\n" % num_bytes
            + headers
            + b"\r\n"
        )
        return read_until_closed(sock, timeout_s=BODY_S / 2)


def test_a_missing_key_is_refused_before_the_body(keyed_server: EchoServer) -> None:
    data, _ = _send_without_body(keyed_server, b"content-type: application/json\r\n")
    assert status_of(data) == 401
    assert json_of(data)["error"]["code"] == "invalid_api_key"
    data, _ = _send_without_body(
        keyed_server, b"authorization: Bearer wrong\r\ncontent-type: application/json\r\n"
    )
    assert status_of(data) == 401


def test_auth_comes_before_the_content_type_check(keyed_server: EchoServer) -> None:
    data, _ = _send_without_body(keyed_server, b"content-type: text/plain\r\n")
    assert status_of(data) == 401
    data, _ = _send_without_body(
        keyed_server, b"authorization: Bearer s3cret\r\ncontent-type: text/plain\r\n"
    )
    assert status_of(data) == 415
    headers = {"Authorization": "Bearer s3cret"}
    resp = httpx.post(f"{keyed_server.url}/v1/chat/completions", json=CHAT, headers=headers)
    assert resp.status_code == 200, resp.text


def test_a_wrong_content_type_is_refused_before_the_body(server: EchoServer) -> None:
    for content_type in (b"text/plain", b"application/x-www-form-urlencoded", None):
        header = b"content-type: " + content_type + b"\r\n" if content_type else b""
        data, _ = _send_without_body(server, header)
        assert status_of(data) == 415
        error = json_of(data)["error"]
        assert error["param"] == "Content-Type" and error["code"] == "unsupported_media_type"


def test_an_oversized_declared_body_is_refused_before_it_is_read(server: EchoServer) -> None:
    data, _ = _send_without_body(server, b"content-type: application/json\r\n", 100 << 20)
    assert status_of(data) == 413
    assert json_of(data)["error"]["code"] == "request_too_large"


def test_a_concurrent_request_is_answered_while_a_body_trickles(server: EchoServer) -> None:
    result: dict[str, int] = {}

    def innocent() -> None:
        time.sleep(0.2)
        resp = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=10)
        result["status"] = resp.status_code
        result["tokens"] = resp.json()["usage"]["completion_tokens"]

    thread = threading.Thread(target=innocent)
    with server.connect() as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\ncontent-length: 100\r\n\r\n"
        )
        thread.start()
        for _ in range(3):
            time.sleep(0.1)
            try:
                sock.sendall(b" ")
            except OSError:
                break
        data, _ = read_until_closed(sock, timeout_s=BODY_S + 5)
    thread.join(timeout=10)
    assert status_of(data) == 408
    assert result == {"status": 200, "tokens": 3}
