"""Image decoding in worker processes that a crash, a hang or a memory bloat cannot escape."""

from __future__ import annotations

import logging
import multiprocessing
import struct
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from PIL import Image

from mmserve.errors import ImageDecodeError
from mmserve.processing.decode_budget import Release, hold_until_collected
from mmserve.processing.image_decode import (
    Admit,
    ImageHeader,
    decode_first_frame,
    read_header,
)
from mmserve.processing.video_worker import serve_video
from mmserve.processing.worker_protocol import (
    ERR,
    GO,
    HEADER_REQUEST,
    READY,
    RSS,
    STOP,
    VIDEO_REQUEST,
    Stopped,
    error_of,
    error_of_kind,
    resident_bytes,
    send_error,
    send_ok,
    widen_socket_buffers,
)

logger = logging.getLogger(__name__)

_MAX_PIXELS = struct.Struct("<Q")
_HEADER = struct.Struct("<IIB")
_OK = struct.Struct("<IIQ")
WORKER_START_TIMEOUT_S = 60.0  # a fresh interpreter's imports, on a loaded machine


def _worker_main(conn: Connection) -> None:
    """Worker loop: decode requests until the pipe closes."""
    conn.send_bytes(READY)
    while True:
        try:
            request = conn.recv_bytes()
            data = conn.recv_bytes()
            # Told apart by length first: a bare <Q max_pixels> may start with any byte.
            if len(request) == _MAX_PIXELS.size:
                (max_pixels,) = _MAX_PIXELS.unpack(request)
                _serve_one(conn, data, max_pixels)
            elif request[:1] == HEADER_REQUEST and len(request) == 1 + _MAX_PIXELS.size:
                (max_pixels,) = _MAX_PIXELS.unpack_from(request, 1)
                _serve_header(conn, data, max_pixels)
            elif request[:1] == VIDEO_REQUEST:
                serve_video(conn, data, request[1:])
            else:
                raise OSError("unknown decode worker request")
        except (EOFError, OSError):
            return
        except Stopped:
            continue


def _header_body(header: ImageHeader) -> bytes:
    names = f"{header.format}\0{header.mode}".encode()
    return _HEADER.pack(header.width, header.height, int(header.has_transparency)) + names


def _serve_header(conn: Connection, data: bytes, max_pixels: int) -> None:
    try:
        img, header = read_header(data, max_pixels)
        del img  # opened, never loaded
    except ImageDecodeError as e:
        send_error(conn, e)
        return
    send_ok(conn, _header_body(header), b"")


def _serve_one(conn: Connection, data: bytes, max_pixels: int) -> None:
    try:
        img, header = read_header(data, max_pixels)
        conn.send_bytes(b"H" + _header_body(header))
        if conn.recv_bytes() != GO:
            raise Stopped
        rgb = decode_first_frame(img)
        del img
    except ImageDecodeError as e:
        send_error(conn, e)
        return
    exif = rgb.info.get("exif") or b""
    pixels = rgb.tobytes()
    width, height = rgb.size
    del rgb
    # Measured with only the reply alive: what this worker keeps between decodes, plus one image.
    conn.send_bytes(b"K" + RSS.pack(resident_bytes()) + _OK.pack(width, height, len(exif)) + exif)
    conn.send_bytes(pixels)


class _Worker:
    """One decode process: started by the constructor, usable once `wait_ready` returns."""

    def __init__(self, ctx: multiprocessing.context.BaseContext) -> None:
        self.conn, child = ctx.Pipe()
        for end in (self.conn, child):  # one socket each: its options go with it to the child
            widen_socket_buffers(end)
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()
        child.close()

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether the worker's READY (its imports done) came within `timeout_s`."""
        try:
            return self.conn.poll(timeout_s) and self.conn.recv_bytes() == READY
        except (EOFError, OSError):
            return False

    def recv_reply(self, timeout_s: float, what: str = "image") -> bytes:
        if not self.conn.poll(timeout_s):
            raise error_of(what)(f"decoding the {what} took longer than {timeout_s:g} s")
        return self.conn.recv_bytes()

    def kill(self) -> None:
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)


class DecodeWorkerPool:
    """Up to `num_workers` decode processes, started on first use or by `start_workers`.

    A worker that times out or dies is killed and replaced; only the request it was serving
    fails. A worker whose resident memory after a decode is over `max_rss_bytes` (0: no limit)
    is retired (killed; the next decode starts a fresh one), so that fragmentation left by
    large images cannot accumulate. Thread-safe: the server calls `decode` from worker threads.
    """

    def __init__(self, num_workers: int, timeout_s: float, max_rss_bytes: int) -> None:
        if num_workers <= 0:
            raise ValueError(f"num_workers must be positive, got {num_workers}")
        if max_rss_bytes < 0:
            raise ValueError(f"max_rss_bytes must be >= 0 (0: no limit), got {max_rss_bytes}")
        self.timeout_s = timeout_s
        self.max_rss_bytes = max_rss_bytes
        self.num_workers = num_workers
        self.num_started = 0
        self.num_retired = 0
        self._ctx = multiprocessing.get_context("spawn")
        self._slots = threading.BoundedSemaphore(num_workers)
        # Guards the counts, the idle stack and _closed; notified when a worker goes idle or
        # away (a decode may wait for one that `start_workers` is starting).
        self._changed = threading.Condition()
        self._idle: list[_Worker] = []  # a stack: the most recently used worker first
        self._num_live = 0  # workers started and not yet killed (idle, busy or starting)
        self._closed = False

    def start_workers(self, timeout_s: float = WORKER_START_TIMEOUT_S) -> int:
        """Start every worker the pool lacks now, all at once, and leave them idle; returns
        how many started. A server calls it at start-up: a worker's start is ~0.2 s of one
        core (a fresh interpreter and its imports), which the first images would otherwise
        wait for, on the cores that are serving them. A worker that does not start is logged
        and left to the first decode to start again."""
        with self._changed:
            missing = 0 if self._closed else self.num_workers - self._num_live
            self._count_started(missing)
        started = 0
        for worker in [_Worker(self._ctx) for _ in range(missing)]:  # all start at once
            if not worker.wait_ready(timeout_s):
                logger.warning("an image decode worker did not start; the first decode retries")
                self._forget(worker)
            elif self._keep(worker):
                started += 1
        return started

    def decode(
        self,
        data: bytes,
        max_pixels: int,
        *,
        admit: Admit | None = None,
        timeout_s: float | None = None,
    ) -> Image.Image:
        """Decode in a worker; `admit` as in `decode_image_bytes`, run here in the parent.

        `timeout_s` (default: the pool's) bounds each wait on the worker: for the header, and
        for the pixels once admitted.
        """

        def on_header(reply: bytes) -> Release | None:
            return admit(_parse_header(reply)) if admit is not None else None

        body, pixels, release = self.exchange(
            _MAX_PIXELS.pack(max_pixels), data, on_header, timeout_s, "image"
        )
        try:
            width, height, exif_len = _OK.unpack_from(body)
            exif = body[_OK.size : _OK.size + exif_len]
            image = Image.frombytes("RGB", (width, height), pixels)
        except BaseException:
            if release is not None:
                release()
            raise
        del pixels
        if exif:
            image.info["exif"] = exif
        hold_until_collected(image, release)
        return image

    def read_header(
        self, data: bytes, max_pixels: int, *, timeout_s: float | None = None
    ) -> ImageHeader:
        """The image's header with the pixel cap checked (`read_header` in a worker): the
        same errors as `decode` gives before decoding, and no pixel is ever decoded."""

        def no_header_step(reply: bytes) -> Release | None:
            raise AssertionError("a header-only request is answered without a header step")

        request = HEADER_REQUEST + _MAX_PIXELS.pack(max_pixels)
        body, payload, _ = self.exchange(request, data, no_header_step, timeout_s, "image")
        assert not payload, "a header-only request is answered without pixels"
        return _parse_header(b"H" + body)

    def exchange(
        self,
        request: bytes,
        data: bytes,
        on_header: Callable[[bytes], Release | None],
        timeout_s: float | None,
        what: str,
    ) -> tuple[bytes, bytes, Release | None]:
        """One decode in a worker: send (request, data); on its header reply call `on_header`
        (which may refuse: the worker is told to stop); return the K reply's body (after its
        rss field), the payload message, and what `on_header` returned (the caller's to
        release). `what` names the media in errors ("image", "video")."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self._closed:
            raise RuntimeError("DecodeWorkerPool is closed")
        release: Release | None = None
        try:
            with self._slots:
                worker = self._checkout()
                healthy, rss_bytes = False, 0
                try:
                    worker.conn.send_bytes(request)
                    worker.conn.send_bytes(data)
                    reply = worker.recv_reply(timeout_s, what)
                    if reply[:1] == b"H":
                        try:
                            release = on_header(reply)
                        except BaseException:
                            worker.conn.send_bytes(STOP)
                            healthy = True
                            raise
                        worker.conn.send_bytes(GO)
                        reply = worker.recv_reply(timeout_s, what)
                    if reply[:1] == b"E":
                        rss_bytes, kind = ERR.unpack_from(reply, 1)
                        healthy = True
                        raise error_of_kind(kind, reply[1 + ERR.size :].decode())
                    if reply[:1] != b"K":
                        raise OSError(f"unexpected reply from a {what} decode worker")
                    (rss_bytes,) = RSS.unpack_from(reply, 1)
                    payload = worker.recv_reply(timeout_s, what)
                    healthy = True
                except (EOFError, OSError):
                    logger.warning("a %s decode worker died; replacing it", what)
                    raise error_of(what)(
                        f"the {what} could not be decoded (decoder failed)"
                    ) from None
                finally:
                    self._give_back(worker, healthy, rss_bytes)
        except BaseException:
            if release is not None:
                release()
            raise
        return reply[1 + RSS.size :], payload, release

    def _give_back(self, worker: _Worker, healthy: bool, rss_bytes: int) -> None:
        """Return a worker to the idle stack, or kill it (broken, closed pool, or too big)."""
        over = bool(self.max_rss_bytes) and rss_bytes > self.max_rss_bytes
        if healthy and not over:
            self._keep(worker)
            return
        if healthy and over:
            with self._changed:
                self.num_retired += 1
            logger.info(
                "retiring an image decode worker at %.0f MiB resident (limit %.0f MiB, "
                "--decode-worker-max-rss-mb)",
                rss_bytes / (1 << 20),
                self.max_rss_bytes / (1 << 20),
            )
        self._forget(worker)

    def _checkout(self) -> _Worker:
        """An idle worker, else a new one while the pool has room; else (the caller holds a
        slot, so a worker is starting in `start_workers`) wait for that one."""
        with self._changed:
            room = self._changed.wait_for(
                lambda: self._idle or self._num_live < self.num_workers, WORKER_START_TIMEOUT_S
            )
            if not room:
                raise RuntimeError("image decode worker did not start")
            if self._idle:
                return self._idle.pop()
            self._count_started(1)
        worker = _Worker(self._ctx)
        if not worker.wait_ready(WORKER_START_TIMEOUT_S):
            self._forget(worker)
            raise RuntimeError("image decode worker did not start")
        return worker

    def _count_started(self, n: int) -> None:
        """Count `n` workers about to start against the pool's size (`_changed` held)."""
        self._num_live += n
        self.num_started += n

    def _keep(self, worker: _Worker) -> bool:
        """Put a ready worker on the idle stack; a closed pool kills it instead (False)."""
        with self._changed:
            if not self._closed:
                self._idle.append(worker)
                self._changed.notify()
                return True
        self._forget(worker)
        return False

    def _forget(self, worker: _Worker) -> None:
        """Kill a worker that will not be used again."""
        worker.kill()
        with self._changed:
            self._num_live -= 1
            self._changed.notify()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            self._forget(worker)


def _parse_header(reply: bytes) -> ImageHeader:
    width, height, flags = _HEADER.unpack_from(reply, 1)
    fmt, _, mode = reply[1 + _HEADER.size :].decode().partition("\0")
    return ImageHeader(fmt, width, height, mode, has_transparency=bool(flags))
