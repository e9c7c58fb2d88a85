"""The hostile-request battery against two real servers: an open one and a keyed one.

Every case is a request an attacker (or a buggy client) sent to a live server. Each must get a
4xx (or the documented 2xx) that names the problem, while an innocent request running at the
same time is answered exactly as it is on a quiet server, and the server stays healthy. After
the battery every KV block and encoder slot is free and RSS is within 200 MB of where it began.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from mmserve.config.model import bundled_toy_model_dir
from tests.api.hostile import (
    Reply,
    chat_body,
    example,
    healthy,
    is_closed,
    media_server,
    png_data_url,
    post,
    raw_exchange,
    rss_bytes,
)
from tests.support.harness import Server, wait_until_idle

HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
RSS_SLACK_BYTES = 200 << 20
KEYS = ("key-a", "key-b")
EXIF_UNIQUE_ID = 0xA420


@dataclass
class Target:
    server: Server
    key: str | None
    innocent_body: dict
    innocent_answer: str
    rss_start: int
    media_port: int | None = None
    other_port: int | None = None
    local_dir: Path | None = None

    def innocent(self) -> Reply:
        return post(self.server, self.innocent_body, key=self.key)

    def post(self, body, **kwargs) -> Reply:
        kwargs.setdefault("key", self.key)
        return post(self.server, body, **kwargs)


def _innocent_body() -> dict:
    # Long enough (ignore_eos) to share engine steps with whatever the hostile request does.
    return chat_body(png_data_url(example("red_circle")), max_tokens=24, ignore_eos=True)


def _start(server: Server, key: str | None, **extra) -> Target:
    target = Target(server, key, _innocent_body(), "", 0, **extra)
    first = target.innocent()
    assert first.status == 200, first
    for _ in range(3):  # warm up: allocator pools, decode workers, the processor cache
        assert target.innocent().text == first.text
    target.innocent_answer = first.text
    target.rss_start = rss_bytes(server.proc.pid)
    return target


@pytest.fixture(scope="module")
def local_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    example("red_circle").save(root / "red.png")
    return root


@pytest.fixture(scope="module")
def open_server(tmp_path_factory, local_dir) -> Iterator[Target]:
    srv = Server(
        bundled_toy_model_dir(),
        tmp_path_factory.mktemp("open") / "server.log",
        "--allowed-local-media-path", str(local_dir),
        "--http-header-timeout", str(HEADER_TIMEOUT_S),
        "--http-body-timeout", str(BODY_TIMEOUT_S),
    )  # fmt: skip
    try:
        yield _start(srv, None, local_dir=local_dir)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory) -> Iterator[Target]:
    images = {"red": example("red_circle"), "blue": example("blue_square")}
    with media_server(images) as media_port, media_server(images) as other_port:
        srv = Server(
            bundled_toy_model_dir(),
            tmp_path_factory.mktemp("keyed") / "server.log",
            "--api-key", *KEYS,
            "--allowed-media-domains", f"127.0.0.1:{media_port}",
            "--trust-exif-image-id",
            "--http-header-timeout", str(HEADER_TIMEOUT_S),
        )  # fmt: skip
        try:
            yield _start(srv, KEYS[0], media_port=media_port, other_port=other_port)
        finally:
            srv.stop()


def alongside(target: Target, hostile: Callable[[], Reply]) -> Reply:
    """Run `hostile` while an innocent request is in flight; the innocent must be unchanged."""
    result: dict[str, Reply] = {}
    worker = threading.Thread(target=lambda: result.setdefault("innocent", target.innocent()))
    worker.start()
    time.sleep(0.05)  # let the innocent request reach the engine first
    reply = hostile()
    worker.join(timeout=120)
    innocent = result["innocent"]
    assert innocent.status == 200, innocent
    assert innocent.text == target.innocent_answer
    assert healthy(target.server)
    return reply


def assert_refused(reply: Reply, status: int, param: str | None = None) -> None:
    assert reply.status == status, reply
    assert reply.message, reply
    if param is not None:
        assert reply.param is not None and reply.param.split(".")[0] == param, reply


def _raw_body(target: Target, **overrides_json: str) -> str:
    """The innocent body as JSON text with some fields spelled as raw JSON (NaN, 1e5000...)."""
    body = dict(target.innocent_body, max_tokens=4, ignore_eos=False)
    text = json.dumps(body)[:-1]
    for name, raw in overrides_json.items():
        text += f', "{name}": {raw}'
    return text + "}"


# ---- numbers and sampling ------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, raw",
    [
        ("seed", str(2**64)),
        ("seed", str(-(2**63) - 1)),
        ("temperature", "NaN"),
        ("temperature", "Infinity"),
        ("temperature", "-Infinity"),
        ("temperature", "-0.5"),
        ("top_p", "0"),
        ("top_p", "1.5"),
        ("top_k", "-2"),
        ("max_tokens", "1" + "0" * 5000),
        ("max_tokens", "0"),
        ("min_tokens", "-1"),
        ("n", "0"),
        ("n", "129"),
    ],
)
def test_out_of_range_numbers_are_a_400_naming_the_field(open_server, field, raw):
    reply = alongside(open_server, lambda: open_server.post(_raw_body(open_server, **{field: raw})))
    assert_refused(reply, 400, field)


def test_a_tiny_temperature_is_clamped_not_a_failure(open_server):
    reply = alongside(
        open_server, lambda: open_server.post(_raw_body(open_server, temperature="1e-300"))
    )
    assert reply.status == 200, reply
    assert reply.text == "a red circle"


@pytest.mark.parametrize(
    "field, value",
    [
        ("length_penalty", 2.0),
        ("best_of", 3),
        ("chat_template", "{{ messages }}"),
        ("tool_choice", "required"),  # with no tools to choose from
        ("structural_tag", "{}"),
    ],
)
def test_fields_we_would_silently_ignore_are_refused(open_server, field, value):
    body = dict(open_server.innocent_body, max_tokens=4, **{field: value})
    assert_refused(alongside(open_server, lambda: open_server.post(body)), 400, field)


# ---- the JSON itself -------------------------------------------------------------------------


def test_json_nested_50000_deep(open_server):
    body = '{"model": "mmserve-toy", "messages": ' + "[" * 50_000 + "]" * 50_000 + "}"
    assert_refused(alongside(open_server, lambda: open_server.post(body)), 400)


def test_a_lone_surrogate_in_a_string(open_server):
    text = json.dumps(open_server.innocent_body).replace(
        json.dumps("What is in the image?"), '"What \\ud800 is in the image?"'
    )
    assert "\\ud800" in text
    assert_refused(alongside(open_server, lambda: open_server.post(text)), 400, "messages")


def test_chat_template_kwargs_naming_a_template_argument(open_server):
    for name in ("messages", "add_generation_prompt"):
        body = dict(open_server.innocent_body, chat_template_kwargs={name: []})
        reply = alongside(open_server, lambda body=body: open_server.post(body))
        assert_refused(reply, 400, "chat_template_kwargs")
        assert name in reply.message


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""],
)
def test_only_json_bodies_are_accepted(open_server, content_type):
    body = json.dumps(open_server.innocent_body)
    reply = alongside(open_server, lambda: open_server.post(body, content_type=content_type))
    assert_refused(reply, 415)


def test_a_1_mib_uuid_is_refused(open_server):
    body = open_server.innocent_body | {"max_tokens": 4}
    part = dict(body["messages"][0]["content"][0])
    part["image_url"] = dict(part["image_url"], uuid="u" * (1 << 20))
    body["messages"] = [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]
    assert_refused(alongside(open_server, lambda: open_server.post(body)), 400, "messages")


# ---- media ------------------------------------------------------------------------------------


def test_file_urls_outside_the_root_look_the_same_whether_or_not_they_exist(open_server):
    def ask(url: str) -> Reply:
        return open_server.post(chat_body(url))

    existing = alongside(open_server, lambda: ask("file:///etc/hostname"))
    missing = alongside(open_server, lambda: ask("file:///etc/no-such-file-for-mmserve"))
    assert_refused(existing, 400)
    assert (existing.status, existing.message) == (missing.status, missing.message)
    inside = ask(f"file://{open_server.local_dir}/red.png")
    assert inside.status == 200 and inside.text == "a red circle"


@pytest.mark.parametrize("path", ["/a%00b.png", "/a\u0000b.png"])
def test_a_nul_byte_in_a_file_url(open_server, path):
    url = f"file://{open_server.local_dir}{path}"
    assert_refused(alongside(open_server, lambda: open_server.post(chat_body(url))), 400)


def test_exif_image_ids_are_not_an_identity_by_default(open_server):
    exif = Image.Exif()
    exif[EXIF_UNIQUE_ID] = "same-id-for-two-pictures"
    red = open_server.post(chat_body(png_data_url(example("red_circle"), exif=exif)))
    blue = open_server.post(chat_body(png_data_url(example("blue_square"), exif=exif)))
    assert (red.text, blue.text) == ("a red circle", "a blue square")


def test_one_bit_9000x9000_pngs_cost_no_memory(open_server):
    image = Image.new("1", (9000, 9000), 0)
    url = png_data_url(image, optimize=True)
    assert len(url) < 100_000  # a few KB on the wire
    before = rss_bytes(open_server.server.proc.pid)
    for _ in range(3):
        assert_refused(alongside(open_server, lambda: open_server.post(chat_body(url))), 400)
    assert rss_bytes(open_server.server.proc.pid) - before < 100 << 20


# ---- connections --------------------------------------------------------------------------


def test_half_open_connections_are_closed_after_the_header_timeout(open_server):
    port = open_server.server.port
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    try:
        for i, sock in enumerate(sockets):
            if i % 2:  # half send nothing, half a partial request line
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        assert open_server.innocent().text == open_server.innocent_answer
        deadline = time.monotonic() + HEADER_TIMEOUT_S + 5
        for sock in sockets:
            assert is_closed(sock, max(0.1, deadline - time.monotonic()))
    finally:
        for sock in sockets:
            sock.close()
    assert healthy(open_server.server)


def test_a_body_that_never_finishes_times_out(open_server):
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"model":'
    )
    start = time.monotonic()
    answer = raw_exchange(open_server.server.port, head, wait_s=BODY_TIMEOUT_S + 5)
    assert time.monotonic() - start < BODY_TIMEOUT_S + 4
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:200]


# ---- the keyed server -------------------------------------------------------------------------


def test_without_a_key_the_body_is_not_read(keyed_server):
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 60000000\r\n\r\n"
    )
    start = time.monotonic()
    answer = raw_exchange(keyed_server.server.port, head, wait_s=5)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert time.monotonic() - start < 3
    wrong = keyed_server.post(keyed_server.innocent_body, key="not-a-key")
    assert_refused(wrong, 401)


def test_slow_fetches_do_not_stall_inline_requests(keyed_server):
    slow_url = f"http://127.0.0.1:{keyed_server.media_port}/slow.png"
    slow: list[Reply] = []
    threads = [
        threading.Thread(target=lambda: slow.append(keyed_server.post(chat_body(slow_url))))
        for _ in range(12)
    ]
    for t in threads:
        t.start()
    time.sleep(1.0)  # every slow fetch is now holding its connection open
    start = time.monotonic()
    inline = keyed_server.post(chat_body(png_data_url(example("blue_square"))))
    elapsed = time.monotonic() - start
    assert inline.status == 200 and inline.text == "a blue square"
    assert elapsed < 3.0, f"an inline request took {elapsed:.1f} s behind 12 slow fetches"
    for t in threads:
        t.join(timeout=60)
    assert len(slow) == 12 and all(400 <= r.status < 500 for r in slow), slow


def test_the_allowlist_names_the_port(keyed_server):
    good = keyed_server.post(chat_body(f"http://127.0.0.1:{keyed_server.media_port}/red.png"))
    assert good.status == 200 and good.text == "a red circle"
    other = f"http://127.0.0.1:{keyed_server.other_port}/red.png"
    reply = alongside(keyed_server, lambda: keyed_server.post(chat_body(other)))
    assert_refused(reply, 400)
    assert str(keyed_server.other_port) in reply.message


def test_trusted_exif_ids_stay_inside_the_callers_namespace(keyed_server):
    exif = Image.Exif()
    exif[EXIF_UNIQUE_ID] = "tenant-photo-1"
    red = keyed_server.post(chat_body(png_data_url(example("red_circle"), exif=exif)), key="key-a")
    blue = keyed_server.post(
        chat_body(png_data_url(example("blue_square"), exif=exif)), key="key-b"
    )
    assert (red.text, blue.text) == ("a red circle", "a blue square")


# ---- after the battery ------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["open_server", "keyed_server"])
def test_after_the_battery_everything_is_free_and_rss_is_back(which, request):
    target: Target = request.getfixturevalue(which)
    assert healthy(target.server)
    assert target.innocent().text == target.innocent_answer
    wait_until_idle(target.server.url, timeout_s=30)
    grown = rss_bytes(target.server.proc.pid) - target.rss_start
    assert grown < RSS_SLACK_BYTES, f"RSS grew by {grown / 2**20:.0f} MiB over the battery"
