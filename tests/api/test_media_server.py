"""Media through a real toy-model server: identities that cannot be forged, fair fetching,
file:// answers that reveal nothing, bounded UUIDs, the host:port allowlist; videos from every
source under the same policy, and hostile videos that get a 4xx while the server stays up.

The toy model names the shape and colour it sees, so an image answered from another image's
cache entry shows up as a wrong answer.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image
from scripts.toy_data import COLOURS, Picture, Shape, draw

from mmserve.config.model import bundled_toy_model_dir
from tests.support.factory import huge_frame_header, png_bytes, video_bytes
from tests.support.harness import Server, data_url, wait_until_idle
from tests.support.media_server import MediaServer, running_media_server

MODEL = "mmserve-toy"
SIZE = 168
EXIF_ID = "d41d8cd98f00b204e9800998ecf8427e"
NUM_SLOW = 12


def _picture(kind: str, colour: str) -> Image.Image:
    """One big shape in the middle of a grey square; same size for every kind and colour."""
    shape = Shape(kind, colour, COLOURS[colour], SIZE * 0.5, SIZE * 0.5, SIZE * 0.35)
    return draw(Picture(SIZE, SIZE, (128, 128, 128), (shape,)))


def _png_url(image: Image.Image, exif_id: str | None = None) -> str:
    buf = io.BytesIO()
    if exif_id is None:
        image.save(buf, format="PNG")
    else:
        exif = Image.Exif()
        exif[0xA420] = exif_id  # ImageUniqueID
        image.save(buf, format="PNG", exif=exif.tobytes())
    return data_url(buf.getvalue())


def _body(image_url: dict, question: str = "What is in the image?", **extra) -> dict:
    parts = [{"type": "image_url", "image_url": image_url}, {"type": "text", "text": question}]
    messages = [{"role": "user", "content": parts}]
    return {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, **extra}


def _post(server: Server, body: dict, key: str | None = None, timeout: float = 60):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=timeout
    )


def _answer(server: Server, image_url: dict, key: str | None = None) -> str:
    resp = _post(server, _body(image_url), key)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"].strip()


@pytest.fixture(scope="module")
def web() -> Iterator[MediaServer]:
    with running_media_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("allowed")
    (root / "ok.png").write_bytes(png_bytes(28, 28))
    (root / "clip.mp4").write_bytes(video_bytes(8, 32, 32, fps=4))
    return root


@pytest.fixture(scope="module")
def server(web: MediaServer, media_dir: Path, tmp_path_factory) -> Iterator[Server]:
    srv = Server(
        bundled_toy_model_dir(),
        tmp_path_factory.mktemp("open") / "server.log",
        "--allowed-media-domains", f"127.0.0.1:{web.port}",
        "--allowed-local-media-path", str(media_dir),
        "--media-fetch-timeout", "6",
    )  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def trusting(tmp_path_factory) -> Iterator[Server]:
    srv = Server(
        bundled_toy_model_dir(),
        tmp_path_factory.mktemp("trusting") / "server.log",
        "--api-key", "key-alice", "key-bob",
        "--trust-exif-image-id",
    )  # fmt: skip
    yield srv
    srv.stop()


def test_two_pictures_with_one_exif_id_are_two_images(server: Server) -> None:
    red = {"url": _png_url(_picture("circle", "red"), EXIF_ID)}
    blue = {"url": _png_url(_picture("square", "blue"), EXIF_ID)}
    assert _answer(server, red) == "a red circle"
    assert _answer(server, blue) == "a blue square"
    assert _answer(server, red) == "a red circle"
    wait_until_idle(server.url)


def test_a_trusted_exif_id_is_shared_only_inside_one_namespace(trusting: Server) -> None:
    red = {"url": _png_url(_picture("circle", "red"), EXIF_ID)}
    blue = {"url": _png_url(_picture("square", "blue"), EXIF_ID)}
    assert _answer(trusting, red, "key-alice") == "a red circle"
    # What --trust-exif-image-id means: inside alice's namespace the id names the picture.
    assert _answer(trusting, blue, "key-alice") == "a red circle"
    # bob's namespace never sees alice's claim.
    assert _answer(trusting, blue, "key-bob") == "a blue square"
    wait_until_idle(trusting.url)


def test_slow_media_servers_do_not_stall_inline_requests(server: Server, web: MediaServer) -> None:
    slow_body = _body({"url": f"{web.base}/trickle"})
    inline_body = _body({"url": _png_url(_picture("star", "green"))})

    async def main() -> tuple[float, int, int, list[int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            slow = [
                asyncio.ensure_future(client.post("/v1/chat/completions", json=slow_body))
                for _ in range(NUM_SLOW)
            ]
            in_flight = await asyncio.to_thread(web.wait_for_active, NUM_SLOW, 5.0)
            start = time.monotonic()
            inline = await client.post("/v1/chat/completions", json=inline_body)
            elapsed = time.monotonic() - start
            statuses = [r.status_code for r in await asyncio.gather(*slow)]
            return elapsed, in_flight, inline.status_code, statuses

    elapsed, in_flight, inline_status, slow_statuses = asyncio.run(main())
    assert inline_status == 200
    assert elapsed < 2.0, f"an inline request took {elapsed:.1f} s behind {in_flight} slow fetches"
    assert in_flight == NUM_SLOW
    assert all(400 <= s < 500 for s in slow_statuses), slow_statuses  # a trickle is no image
    assert httpx.get(f"{server.url}/health").status_code == 200
    wait_until_idle(server.url)


def test_file_urls_reveal_nothing_outside_the_root(
    server: Server, media_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "exists.png").write_bytes(png_bytes(28, 28))
    outside_existing = _post(server, _body({"url": f"file://{tmp_path}/exists.png"}))
    outside_missing = _post(server, _body({"url": f"file://{tmp_path}/missing.png"}))
    assert outside_existing.status_code == outside_missing.status_code == 400
    assert outside_existing.json() == outside_missing.json()
    for path in ("/ok.png\x00.txt", "/ok.png%00.txt", "/%ff.png"):
        resp = _post(server, _body({"url": f"file://{media_dir}{path}"}))
        assert resp.status_code == 400, (path, resp.text)
        assert resp.json()["error"]["param"] == "image_url"
    missing = _post(server, _body({"url": f"file://{media_dir}/missing.png"}))
    assert missing.status_code == 400 and "names no file" in missing.json()["error"]["message"]
    assert _post(server, _body({"url": f"file://{media_dir}/ok.png"})).status_code == 200


def test_long_or_unprintable_uuids_are_refused(server: Server) -> None:
    url = _png_url(_picture("circle", "purple"))
    huge = _post(server, _body({"url": url, "uuid": "u" * (1 << 20)}))
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "messages"
    assert "at most 256" in huge.json()["error"]["message"]
    control = _post(server, _body({"url": url, "uuid": "a\nb"}))
    assert control.status_code == 400
    by_field = _post(server, _body({"url": url}, multi_modal_uuids={"image": ["m" * 300]}))
    assert by_field.status_code == 400
    assert by_field.json()["error"]["param"] == "multi_modal_uuids"
    # the longest allowed one names the picture, and a later uuid-only request finds it
    assert _answer(server, {"url": url, "uuid": "u" * 256}) == "a purple circle"
    assert _answer(server, {"uuid": "u" * 256}) == "a purple circle"


def test_an_allowlisted_host_is_fetched_on_its_listed_port_only(
    server: Server, web: MediaServer
) -> None:
    before = len(web.requests_seen)
    other_port = _post(server, _body({"url": f"http://127.0.0.1:{web.port + 1}/img.png"}))
    default_port = _post(server, _body({"url": "http://127.0.0.1/img.png"}))
    for resp, port in ((other_port, web.port + 1), (default_port, 80)):
        assert resp.status_code == 400
        assert f"port {port} is not allowed" in resp.json()["error"]["message"]
    web.redirect_target = f"http://127.0.0.1:{web.port + 1}/img.png"
    assert _post(server, _body({"url": f"{web.base}/redirect"})).status_code == 400
    assert web.requests_seen[before:] == ["/redirect"]  # only the listed port was contacted
    assert _post(server, _body({"url": f"{web.base}/img.png"})).status_code == 200


SMALL = {"min_pixels": 3136, "max_pixels": 12544}  # a few tokens per video frame pair


def _post_video(server: Server, url: str, **kwargs: object) -> httpx.Response:
    parts = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What?"}]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 4,
        "temperature": 0,
        "mm_processor_kwargs": SMALL,
        **kwargs,
    }
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_videos_from_every_allowed_source(
    server: Server, web: MediaServer, media_dir: Path
) -> None:
    for url in (
        data_url(video_bytes(8, 32, 32, fps=4), "video/mp4"),
        (media_dir / "clip.mp4").as_uri(),
        f"{web.base}/clip.mp4",
    ):
        resp = _post_video(server, url)
        assert resp.status_code == 200, (url[:40], resp.text)
        assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length")
    by_field = _post_video(server, f"{web.base}/clip.mp4", multi_modal_uuids={"video": ["v-9"]})
    by_uuid = _post_video(server, "", multi_modal_uuids={"video": ["v-9"]})
    assert by_field.status_code == by_uuid.status_code == 200, by_uuid.text
    assert by_uuid.json()["usage"]["prompt_tokens"] == by_field.json()["usage"]["prompt_tokens"]
    # the same policy as images: a path outside the allowed directory, an unlisted host
    outside = _post_video(server, "file:///etc/passwd")
    assert outside.status_code == 400 and "allowed-local-media-path" in outside.text
    assert outside.json()["error"]["param"] == "video_url"
    unlisted = _post_video(server, "http://127.0.0.2:1/clip.mp4")
    assert unlisted.status_code == 400


@pytest.mark.parametrize(
    ("url", "kwargs", "param", "needle"),
    [
        (data_url(video_bytes(11, 32, 32, fps=1, seconds_per_frame=3600), "video/mp4"), {},
         "video_url", "--max-video-seconds"),
        (data_url(huge_frame_header(), "video/avi"), {}, "video_url", "8000x8000"),
        (data_url(video_bytes(8, 32, 32, fps=4), "video/mp4"),
         {"mm_processor_kwargs": {**SMALL, "max_frames": 100_000}},
         "mm_processor_kwargs.max_frames", "over this server's limit of 768"),
        (data_url(video_bytes(20)[:1500], "video/mp4"), {}, "video_url", "truncated"),
        (data_url(png_bytes(32, 32), "video/mp4"), {}, "video_url", "not a supported video"),
        (data_url(bytes(range(256)) * 16, "video/mp4"), {}, "video_url", "not a supported"),
        (data_url(png_bytes(32, 32)), {}, "video_url", "is not a video type"),
    ],
    ids=["ten-hours", "8000x8000", "max-frames-raised", "truncated", "png", "random", "mime"],
)  # fmt: skip
def test_hostile_videos_are_4xx_within_seconds(
    server: Server, url: str, kwargs: dict, param: str, needle: str
) -> None:
    start = time.monotonic()
    resp = _post_video(server, url, **kwargs)
    assert time.monotonic() - start < 5.0
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and needle in error["message"]
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    normal = _post_video(server, data_url(video_bytes(8, 32, 32, fps=4, seed=1), "video/mp4"))
    assert normal.status_code == 200, normal.text
