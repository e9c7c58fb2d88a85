"""The decode workers' pipe protocol: the steps, the reply framing and the typed errors."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Protocol

from mmserve.errors import (
    ImageDecodeError,
    ImageTooLargeError,
    MediaError,
    VideoDecodeError,
    VideoTooLargeError,
)
from mmserve.processing.decode_budget import Release

# Wire format (no pickle), one message per step; the parent's admit runs between (2) and (3):
#   (1) parent -> worker  <Q max_pixels>, then the encoded image bytes as a second message
#   (2) worker -> parent  b"H" + <IIB width, height, has_transparency> + format NUL mode
#   (3) parent -> worker  b"G" (go: decode) or b"S" (stop: the parent refused; next request)
#   (4) worker -> parent  b"K" + <Q rss_bytes> + <IIQ width, height, exif_len> + exif, then
#                         the packed RGB pixels as a second message
# A video request is b"V" + its JSON spec at (1), and its own header and K body
# (video_worker.py); the steps are the same. A header-only request (a disaggregated server
# plans images it never decodes) is b"R" + <Q max_pixels> at (1), answered at once by
#   (4') worker -> parent  b"K" + <Q rss_bytes> + <IIB ...> + format NUL mode (step (2)'s body),
#                          then an empty payload message; no pixel is decoded.
#       or, at (2) or (4): b"E" + <QB rss_bytes, error kind> + utf-8 message (ours, never
#                          the library's)
RSS = struct.Struct("<Q")
ERR = struct.Struct("<QB")  # rss_bytes, error kind (index into _ERROR_KINDS)
_ERROR_KINDS: tuple[type[MediaError], ...] = (
    ImageDecodeError,
    ImageTooLargeError,
    VideoDecodeError,
    VideoTooLargeError,
)
READY, GO, STOP = b"ready", b"G", b"S"
VIDEO_REQUEST = b"V"
HEADER_REQUEST = b"R"


class WorkerExchange(Protocol):
    """One request/reply round with a decode worker (`DecodeWorkerPool.exchange`)."""

    def exchange(
        self,
        request: bytes,
        data: bytes,
        on_header: Callable[[bytes], Release | None],
        timeout_s: float | None,
        what: str,
    ) -> tuple[bytes, bytes, Release | None]: ...


def send_error(conn: Connection, e: MediaError) -> None:
    """Step (2) or (4) failed with the client's error: tell the parent, typed."""
    kind = _ERROR_KINDS.index(type(e)) if type(e) in _ERROR_KINDS else 0
    conn.send_bytes(b"E" + ERR.pack(resident_bytes(), kind) + e.message.encode())


def send_ok(conn: Connection, body: bytes, payload: bytes) -> None:
    """Step (4) succeeded: the K reply (rss first, then `body`) and the payload message."""
    conn.send_bytes(b"K" + RSS.pack(resident_bytes()) + body)
    conn.send_bytes(payload)


class Stopped(Exception):
    """The parent refused the image after reading its header."""


def resident_bytes() -> int:
    """This process's resident set size from /proc/self/statm (0 where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def error_of_kind(kind: int, message: str) -> MediaError:
    """The typed error an E reply names (its kind indexes the error types)."""
    cls = _ERROR_KINDS[kind] if kind < len(_ERROR_KINDS) else ImageDecodeError
    if issubclass(cls, VideoDecodeError):
        return cls(message, param="video_url")
    return cls(message, param="image_url" if cls is ImageTooLargeError else None)


def error_of(what: str) -> type[MediaError]:
    return VideoDecodeError if what == "video" else ImageDecodeError


# What each end of a worker's connection asks of the kernel for its socket buffers: a decoded
# 448x448 image is 600 KB of pixels, and with the default ~208 KiB buffers it crosses in
# several fills, each a wake-up of the other process. On two busy cores every wake-up waits
# for a time slice (a decode measured 7-8 ms instead of 4). The kernel caps the request at
# net.core.wmem_max / rmem_max (often 208 KiB: raise them to let a whole image cross at once).
SOCKET_BUFFER_BYTES = 8 << 20


def widen_socket_buffers(conn: Connection) -> None:
    """Ask for SOCKET_BUFFER_BYTES of send and receive buffer on `conn` (a socket pair end on
    POSIX); the kernel grants what its limits allow. Nothing to do for a pipe."""
    fd = os.dup(conn.fileno())
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        return  # not a socket
    with sock:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            # refused outright: the default stays (a slower transfer, nothing more)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
