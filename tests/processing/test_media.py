"""Media loading and decoding: sources, hostile inputs, the decode worker pool."""

from __future__ import annotations

import asyncio
import base64
import io
import multiprocessing
import os
import socket
import struct
import threading
import time
import zlib

import pytest
from PIL import Image

from mmserve.config.media import MediaConfig
from mmserve.errors import ImageDecodeError, ImageTooLargeError, MediaError
from mmserve.processing.decode_workers import DecodeWorkerPool
from mmserve.processing.media import MediaLoader
from mmserve.processing.worker_protocol import SOCKET_BUFFER_BYTES, widen_socket_buffers
from tests.support.factory import flat_png, random_image


def _encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A well-formed PNG header (valid CRCs) for a huge image, with a tiny payload."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_every_source_kind_gives_the_same_rgb_image(tmp_path) -> None:
    image = random_image(20, 12, seed=1)
    png = _encode(image)
    (tmp_path / "a.png").write_bytes(png)
    loader = MediaLoader(MediaConfig(allowed_local_media_path=str(tmp_path)))
    sources = [
        image,
        png,
        "data:image/png;base64," + base64.b64encode(png).decode(),
        f"file://{tmp_path}/a.png",
    ]
    for source in sources:
        loaded = loader.load_image(source)
        assert loaded.mode == "RGB" and loaded.tobytes() == image.tobytes()
    assert asyncio.run(loader.aload_image(png)).tobytes() == image.tobytes()


def test_alpha_is_composited_on_white() -> None:
    rgba = Image.new("RGBA", (2, 1), (10, 20, 30, 0))
    rgba.putpixel((1, 0), (10, 20, 30, 255))
    loaded = MediaLoader().load_image(_encode(rgba))
    assert loaded.getpixel((0, 0)) == (255, 255, 255)
    assert loaded.getpixel((1, 0)) == (10, 20, 30)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (_encode(random_image(64, 64, seed=2))[:200], "truncated or corrupt"),
        (b"GIF89a this is not really an image at all", "not a supported image"),
        (b"hello world, definitely text", "not a supported image"),
        (b"", "empty"),
        (_encode(random_image(8, 8), "TIFF"), "not a supported image"),
    ],
)
def test_hostile_bytes_become_typed_errors_with_our_message(data: bytes, match: str) -> None:
    start = time.monotonic()
    with pytest.raises(ImageDecodeError, match=match) as info:
        MediaLoader().load_image(data)
    assert time.monotonic() - start < 1.0
    assert "cannot identify" not in info.value.message  # Pillow's wording never leaks


def test_decompression_bomb_header_is_refused_before_decoding() -> None:
    start = time.monotonic()
    with pytest.raises(ImageDecodeError, match="pixel limit"):
        MediaLoader().load_image(_png_claiming(60000, 60000))
    assert time.monotonic() - start < 0.5
    with pytest.raises(ImageDecodeError, match="10000x10000 = 100000000 pixels"):
        MediaLoader().load_image(_png_claiming(10000, 10000))  # our header check, not Pillow's
    small_cap = MediaLoader(MediaConfig(max_image_pixels=100))
    with pytest.raises(ImageDecodeError, match="100-pixel limit"):
        small_cap.load_image(_encode(random_image(11, 10)))


def test_bad_data_urls_are_refused() -> None:
    loader = MediaLoader()
    with pytest.raises(MediaError, match="not valid base64"):
        loader.load_image("data:image/png;base64,@@not base64@@")
    with pytest.raises(MediaError, match="not an image type"):
        loader.load_image("data:text/html;base64," + base64.b64encode(b"<html>").decode())
    with pytest.raises(MediaError, match="data:image/png;base64"):
        loader.load_image("data:image/png,rawbytes")
    with pytest.raises(MediaError, match="byte limit"):
        MediaLoader(MediaConfig(max_media_bytes=10)).load_image("data:image/png;base64," + "A" * 40)
    with pytest.raises(MediaError, match="unsupported image source"):
        loader.load_image(12345)  # type: ignore[arg-type]


def test_decode_pool_decodes_and_closes() -> None:
    png = _encode(random_image(50, 40, seed=3))
    with MediaLoader(MediaConfig(decode_workers=1, decode_timeout_s=30)) as loader:
        assert loader.load_image(png).tobytes() == random_image(50, 40, seed=3).tobytes()
        with pytest.raises(ImageDecodeError, match="truncated or corrupt"):
            loader.load_image(png[:100])
        with pytest.raises(ImageDecodeError, match="pixel limit"):
            loader.load_image(_png_claiming(60000, 60000))
    with pytest.raises(RuntimeError, match="closed"):
        _closed_pool().decode(png, 100)


def _kernel_limit(name: str) -> int | None:
    try:
        return int(open(f"/proc/sys/net/core/{name}").read())
    except OSError:
        return None


def test_worker_connections_ask_for_socket_buffers_an_image_fits_in() -> None:
    """A decoded image crosses in one fill where the kernel allows, not in many wake-ups."""
    wmem, rmem = _kernel_limit("wmem_max"), _kernel_limit("rmem_max")
    if wmem is None or rmem is None:
        pytest.skip("no Linux socket buffer limits to compare with")
    parent, child = multiprocessing.get_context("spawn").Pipe()
    defaults = [_buffers(end) for end in (parent, child)]
    for end in (parent, child):
        widen_socket_buffers(end)
    # Linux grants min(asked, its limit) and doubles it (its bookkeeping)
    expected = (2 * min(SOCKET_BUFFER_BYTES, wmem), 2 * min(SOCKET_BUFFER_BYTES, rmem))
    try:
        if any(e < d for e, d in zip(expected, defaults[0], strict=True)):
            pytest.skip("this kernel's limits are below its own defaults")
        for end in (parent, child):
            assert _buffers(end) == expected
    finally:
        parent.close()
        child.close()
    # and a pool's workers decode through such connections
    pool = DecodeWorkerPool(num_workers=1, timeout_s=30, max_rss_bytes=0)
    try:
        image = random_image(640, 480, seed=12)  # 900 KB of pixels: more than one default fill
        assert pool.decode(_encode(image), 10**8).tobytes() == image.tobytes()
    finally:
        pool.close()


def _buffers(end) -> tuple[int, int]:
    sock = socket.socket(fileno=os.dup(end.fileno()))
    with sock:
        return (
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
        )


def _closed_pool() -> DecodeWorkerPool:
    pool = DecodeWorkerPool(1, timeout_s=30, max_rss_bytes=0)
    pool.close()
    return pool


def test_started_workers_serve_the_first_decodes_and_none_start_twice() -> None:
    pool = DecodeWorkerPool(num_workers=2, timeout_s=30, max_rss_bytes=0)
    try:
        assert pool.start_workers() == 2
        assert pool.start_workers() == 0  # the pool is full: nothing more starts
        png = _encode(random_image(40, 30, seed=9))
        for _ in range(3):
            assert pool.decode(png, 10**8).tobytes() == random_image(40, 30, seed=9).tobytes()
        assert pool.num_started == 2  # the decodes used the started workers
    finally:
        pool.close()
    assert _closed_pool().start_workers() == 0


def test_a_decode_during_start_workers_never_makes_the_pool_bigger() -> None:
    # whichever comes first, the decode and the start share the pool's one place
    pool = DecodeWorkerPool(num_workers=1, timeout_s=30, max_rss_bytes=0)
    try:
        starter = threading.Thread(target=pool.start_workers)
        starter.start()
        png = _encode(random_image(40, 30, seed=9))
        assert pool.decode(png, 10**8).tobytes() == random_image(40, 30, seed=9).tobytes()
        starter.join(60)
        assert pool.num_started == 1
        assert pool.start_workers() == 0
    finally:
        pool.close()


def test_a_retired_worker_is_started_again_by_start_workers() -> None:
    pool = DecodeWorkerPool(num_workers=1, timeout_s=30, max_rss_bytes=1)  # every worker is over
    try:
        assert pool.start_workers() == 1
        pool.decode(_encode(random_image(40, 30, seed=6)), 10**8)
        assert (pool.num_started, pool.num_retired) == (1, 1)
        assert pool.start_workers() == 1  # its place is free again
    finally:
        pool.close()


def test_closing_the_loader_stops_the_workers_it_started() -> None:
    assert MediaLoader(MediaConfig()).start_decode_workers() is None  # decodes in-process
    loader = MediaLoader(MediaConfig(decode_workers=2))
    before = set(multiprocessing.active_children())
    thread = loader.start_decode_workers()
    assert thread is not None
    thread.join(60)
    assert len(set(multiprocessing.active_children()) - before) == 2
    loader.close()
    assert not set(multiprocessing.active_children()) - before


def test_a_decode_that_overruns_fails_alone_and_the_pool_recovers() -> None:
    pool = DecodeWorkerPool(num_workers=1, timeout_s=30, max_rss_bytes=0)
    try:
        big = _encode(random_image(1500, 1500, seed=4))
        with pytest.raises(ImageDecodeError, match="took longer than"):
            pool.decode(big, 10**8, timeout_s=1e-4)
        small = random_image(30, 20, seed=5)
        assert pool.decode(_encode(small), 10**8).tobytes() == small.tobytes()
    finally:
        pool.close()


def test_a_worker_over_its_rss_limit_is_retired_and_replaced() -> None:
    png = _encode(random_image(40, 30, seed=6))
    tiny = DecodeWorkerPool(num_workers=1, timeout_s=30, max_rss_bytes=1)  # every worker is over
    try:
        for _ in range(3):
            assert tiny.decode(png, 10**8).tobytes() == random_image(40, 30, seed=6).tobytes()
        assert (tiny.num_started, tiny.num_retired) == (3, 3)
        assert len(multiprocessing.active_children()) <= 1  # retired workers are gone, not idle
    finally:
        tiny.close()
    roomy = DecodeWorkerPool(num_workers=1, timeout_s=30, max_rss_bytes=1 << 30)
    try:
        for _ in range(3):
            roomy.decode(png, 10**8)
        assert (roomy.num_started, roomy.num_retired) == (1, 0)
    finally:
        roomy.close()


def test_worker_refusals_keep_their_kind_and_the_worker() -> None:
    pool = DecodeWorkerPool(num_workers=1, timeout_s=30, max_rss_bytes=0)
    try:
        with pytest.raises(ImageTooLargeError, match="--max-image-pixels") as info:
            pool.decode(flat_png(9000, 9000, "1"), 4096 * 4096)
        assert info.value.param == "image_url"
        seen = []

        def refuse(header):
            seen.append((header.format, header.mode, header.width, header.height))
            raise ImageTooLargeError("refused by the parent")

        with pytest.raises(ImageTooLargeError, match="refused by the parent"):
            pool.decode(flat_png(64, 32, "P"), 10**8, admit=refuse)
        assert seen == [("PNG", "P", 64, 32)]
        assert pool.decode(flat_png(64, 32, "P"), 10**8).size == (64, 32)
        assert pool.num_started == 1  # neither refusal cost a worker
    finally:
        pool.close()
