"""Image decoding in worker processes that a crash, a hang or a memory bloat cannot escape."""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import struct
import threading
from multiprocessing.connection import Connection

from PIL import Image

from mmserve.errors import ImageDecodeError, ImageTooLargeError
from mmserve.processing.decode_budget import Release, hold_until_collected
from mmserve.processing.image_decode import (
    Admit,
    ImageHeader,
    decode_first_frame,
    read_header,
)

logger = logging.getLogger(__name__)

# Wire format (no pickle), one message per step; the parent's admit runs between (2) and (3):
#   (1) parent -> worker  <Q max_pixels>, then the encoded image bytes as a second message
#   (2) worker -> parent  b"H" + <IIB width, height, has_transparency> + format NUL mode
#   (3) parent -> worker  b"G" (go: decode) or b"S" (stop: the parent refused; next request)
#   (4) worker -> parent  b"K" + <IIQQ width, height, exif_len, rss_bytes> + exif, then the
#                         packed RGB pixels as a second message
#       or, at (2) or (4): b"E" + <QB rss_bytes, error kind> + utf-8 message (ours, never
#                          the library's)
_MAX_PIXELS = struct.Struct("<Q")
_HEADER = struct.Struct("<IIB")
_OK = struct.Struct("<IIQQ")
_ERR = struct.Struct("<QB")  # rss_bytes, error kind (index into _ERROR_KINDS)
_ERROR_KINDS: tuple[type[ImageDecodeError], ...] = (ImageDecodeError, ImageTooLargeError)
_READY, _GO, _STOP = b"ready", b"G", b"S"


class _Stopped(Exception):
    """The parent refused the image after reading its header."""


def _rss_bytes() -> int:
    """This process's resident set size from /proc/self/statm (0 where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _worker_main(conn: Connection) -> None:
    """Worker loop: decode requests until the pipe closes."""
    conn.send_bytes(_READY)
    while True:
        try:
            (max_pixels,) = _MAX_PIXELS.unpack(conn.recv_bytes())
            data = conn.recv_bytes()
            _serve_one(conn, data, max_pixels)
        except (EOFError, OSError):
            return
        except _Stopped:
            continue


def _serve_one(conn: Connection, data: bytes, max_pixels: int) -> None:
    try:
        img, header = read_header(data, max_pixels)
        flags = int(header.has_transparency)
        names = f"{header.format}\0{header.mode}".encode()
        conn.send_bytes(b"H" + _HEADER.pack(header.width, header.height, flags) + names)
        if conn.recv_bytes() != _GO:
            raise _Stopped
        rgb = decode_first_frame(img)
        del img
    except ImageDecodeError as e:
        kind = _ERROR_KINDS.index(type(e)) if type(e) in _ERROR_KINDS else 0
        conn.send_bytes(b"E" + _ERR.pack(_rss_bytes(), kind) + e.message.encode())
        return
    exif = rgb.info.get("exif") or b""
    pixels = rgb.tobytes()
    width, height = rgb.size
    del rgb
    # Measured with only the reply alive: what this worker keeps between decodes, plus one image.
    conn.send_bytes(b"K" + _OK.pack(width, height, len(exif), _rss_bytes()) + exif)
    conn.send_bytes(pixels)


class _Worker:
    def __init__(self, ctx: multiprocessing.context.BaseContext, start_timeout_s: float) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(start_timeout_s) or self.conn.recv_bytes() != _READY:
            self.kill()
            raise RuntimeError("image decode worker did not start")

    def recv_reply(self, timeout_s: float) -> bytes:
        if not self.conn.poll(timeout_s):
            raise ImageDecodeError(f"decoding the image took longer than {timeout_s:g} s")
        return self.conn.recv_bytes()

    def kill(self) -> None:
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)


class DecodeWorkerPool:
    """Up to `num_workers` decode processes, started on first use.

    A worker that times out or dies is killed and replaced; only the request it was serving
    fails. A worker whose resident memory after a decode is over `max_rss_bytes` (0: no limit)
    is retired (killed; the next decode starts a fresh one), so that fragmentation left by
    large images cannot accumulate. Thread-safe: the server calls `decode` from worker threads.
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, max_rss_bytes: int = 0):
        if num_workers <= 0:
            raise ValueError(f"num_workers must be positive, got {num_workers}")
        if max_rss_bytes < 0:
            raise ValueError(f"max_rss_bytes must be >= 0 (0: no limit), got {max_rss_bytes}")
        self.timeout_s = timeout_s
        self.max_rss_bytes = max_rss_bytes
        self.num_started = 0
        self.num_retired = 0
        self._ctx = multiprocessing.get_context("spawn")
        self._slots = threading.BoundedSemaphore(num_workers)
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        self._counts_lock = threading.Lock()
        self._closed = False

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
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self._closed:
            raise RuntimeError("DecodeWorkerPool is closed")
        release: Release | None = None
        try:
            with self._slots:
                worker = self._checkout()
                healthy, rss_bytes = False, 0
                try:
                    worker.conn.send_bytes(_MAX_PIXELS.pack(max_pixels))
                    worker.conn.send_bytes(data)
                    reply = worker.recv_reply(timeout_s)
                    if reply[:1] == b"H":
                        try:
                            release = admit(_parse_header(reply)) if admit is not None else None
                        except BaseException:
                            worker.conn.send_bytes(_STOP)
                            healthy = True
                            raise
                        worker.conn.send_bytes(_GO)
                        reply = worker.recv_reply(timeout_s)
                    if reply[:1] == b"E":
                        rss_bytes, kind = _ERR.unpack_from(reply, 1)
                        healthy = True
                        raise _error(kind, reply[1 + _ERR.size :].decode())
                    if reply[:1] != b"K":
                        raise OSError("unexpected reply from an image decode worker")
                    width, height, exif_len, rss_bytes = _OK.unpack_from(reply, 1)
                    exif = reply[1 + _OK.size : 1 + _OK.size + exif_len]
                    pixels = worker.recv_reply(timeout_s)
                    healthy = True
                except (EOFError, OSError):
                    logger.warning("an image decode worker died; replacing it")
                    raise ImageDecodeError(
                        "the image could not be decoded (decoder failed)"
                    ) from None
                finally:
                    self._give_back(worker, healthy, rss_bytes)
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

    def _give_back(self, worker: _Worker, healthy: bool, rss_bytes: int) -> None:
        """Return a worker to the idle stack, or kill it (broken, closed pool, or too big)."""
        over = bool(self.max_rss_bytes) and rss_bytes > self.max_rss_bytes
        if healthy and not over and not self._closed:
            self._idle.put(worker)
            return
        if healthy and over:
            with self._counts_lock:
                self.num_retired += 1
            logger.info(
                "retiring an image decode worker at %.0f MiB resident (limit %.0f MiB, "
                "--decode-worker-max-rss-mb)",
                rss_bytes / (1 << 20),
                self.max_rss_bytes / (1 << 20),
            )
        worker.kill()

    def _checkout(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            with self._counts_lock:
                self.num_started += 1
            return _Worker(self._ctx, start_timeout_s=60.0)

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return


def _parse_header(reply: bytes) -> ImageHeader:
    width, height, flags = _HEADER.unpack_from(reply, 1)
    fmt, _, mode = reply[1 + _HEADER.size :].decode().partition("\0")
    return ImageHeader(fmt, width, height, mode, has_transparency=bool(flags))


def _error(kind: int, message: str) -> ImageDecodeError:
    cls = _ERROR_KINDS[kind] if kind < len(_ERROR_KINDS) else ImageDecodeError
    return cls(message, param="image_url" if cls is ImageTooLargeError else None)
