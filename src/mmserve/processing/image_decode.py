"""Image decoding with a pixel cap, inline or in worker processes a crash or hang cannot escape."""

from __future__ import annotations

import io
import logging
import multiprocessing
import queue
import struct
import threading
import warnings
from multiprocessing.connection import Connection

from PIL import Image, UnidentifiedImageError

from mmserve.errors import ImageDecodeError
from mmserve.processing.image_processor import to_rgb

logger = logging.getLogger(__name__)

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Pillow's own warning threshold; after smart_resize no image needs more than ~12.8 M pixels.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485

# Worker wire format (no pickle):
#   request  = <Q max_pixels> + encoded image bytes
#   reply ok = b"\x00" + <IIQ width, height, exif_len> + exif + RGB pixel bytes
#   reply err= b"\x01" + utf-8 message (ours, never the library's)
_REQUEST = struct.Struct("<Q")
_REPLY_OK = struct.Struct("<IIQ")
_READY = b"ready"


def decode_image_bytes(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode bytes into an RGB image; refuse unknown formats and oversized images before decoding.

    The raw EXIF block (if any) is kept in `info["exif"]` so that the EXIF ImageUniqueID can
    still stand in for content after the RGB conversion.
    """
    if not data:
        raise ImageDecodeError("the image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=list(ALLOWED_FORMATS))
    except Image.DecompressionBombError:
        raise ImageDecodeError(f"the image is over the {max_pixels}-pixel limit") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise ImageDecodeError(
            f"the data is not a supported image; send one of {', '.join(ALLOWED_FORMATS)}"
        ) from None
    width, height = img.size
    if width <= 0 or height <= 0:
        raise ImageDecodeError("the image has an empty side")
    if width * height > max_pixels:
        raise ImageDecodeError(
            f"the image is {width}x{height} = {width * height} pixels, over the "
            f"{max_pixels}-pixel limit; downscale it before sending"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.load()
            exif = img.info.get("exif")
            rgb = to_rgb(img)
            rgb.load()
    except Exception:  # noqa: BLE001 - any decoder failure is the client's bad data
        raise ImageDecodeError(
            f"the {img.format or 'image'} data is truncated or corrupt and could not be decoded"
        ) from None
    if exif and "exif" not in rgb.info:
        rgb.info["exif"] = exif
    return rgb


def _worker_main(conn: Connection) -> None:
    """Worker loop: decode requests until the pipe closes."""
    conn.send_bytes(_READY)
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return
        (max_pixels,) = _REQUEST.unpack_from(request)
        try:
            img = decode_image_bytes(request[_REQUEST.size :], max_pixels)
        except ImageDecodeError as e:
            conn.send_bytes(b"\x01" + e.message.encode())
            continue
        exif = img.info.get("exif") or b""
        header = _REPLY_OK.pack(img.width, img.height, len(exif))
        conn.send_bytes(b"\x00" + header + exif + img.tobytes())


def _unpack_reply(reply: bytes) -> Image.Image:
    if reply[:1] == b"\x01":
        raise ImageDecodeError(reply[1:].decode())
    width, height, exif_len = _REPLY_OK.unpack_from(reply, 1)
    start = 1 + _REPLY_OK.size
    img = Image.frombytes("RGB", (width, height), reply[start + exif_len :])
    if exif_len:
        img.info["exif"] = reply[start : start + exif_len]
    return img


class _Worker:
    def __init__(self, ctx: multiprocessing.context.BaseContext, start_timeout_s: float) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(start_timeout_s) or self.conn.recv_bytes() != _READY:
            self.kill()
            raise RuntimeError("image decode worker did not start")

    def kill(self) -> None:
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)


class DecodeWorkerPool:
    """Up to `num_workers` decode processes, started on first use.

    A worker that times out or dies is killed and replaced; only the request it was serving
    fails. Thread-safe: the server calls `decode` from worker threads.
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0) -> None:
        if num_workers <= 0:
            raise ValueError(f"num_workers must be positive, got {num_workers}")
        self.timeout_s = timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._slots = threading.BoundedSemaphore(num_workers)
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        self._closed = False

    def decode(
        self, data: bytes, max_pixels: int, *, timeout_s: float | None = None
    ) -> Image.Image:
        """Decode in a worker; `timeout_s` overrides the pool's limit for this one call."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self._closed:
            raise RuntimeError("DecodeWorkerPool is closed")
        with self._slots:
            worker = self._checkout()
            healthy = False
            try:
                worker.conn.send_bytes(_REQUEST.pack(max_pixels) + data)
                if not worker.conn.poll(timeout_s):
                    raise ImageDecodeError(f"decoding the image took longer than {timeout_s:g} s")
                reply = worker.conn.recv_bytes()
                healthy = True
            except (EOFError, OSError):
                logger.warning("an image decode worker died; replacing it")
                raise ImageDecodeError("the image could not be decoded (decoder failed)") from None
            finally:
                if healthy and not self._closed:
                    self._idle.put(worker)
                else:
                    worker.kill()
        return _unpack_reply(reply)

    def _checkout(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            return _Worker(self._ctx, start_timeout_s=60.0)

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return
