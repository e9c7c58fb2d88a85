"""Media loading: PIL images, bytes, data: URLs, http(s) URLs and file:// paths -> RGB images."""

from __future__ import annotations

import asyncio
import base64
import binascii
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from PIL import Image

from mmserve.errors import MediaError, MediaFetchRefusedError
from mmserve.processing.decode_budget import DecodeMemoryGate, Release, RequestDecodeBudget
from mmserve.processing.decode_workers import DecodeWorkerPool
from mmserve.processing.image_decode import (
    DEFAULT_MAX_IMAGE_PIXELS,
    Admit,
    ImageHeader,
    decode_image_bytes,
)
from mmserve.processing.image_processor import to_rgb
from mmserve.processing.url_guard import fetch_url

MediaSource = Image.Image | bytes | str


class _NoRoomYet(Exception):
    """Raised from a decode's admit: its estimate does not fit the in-flight cap right now."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.nbytes = nbytes


@dataclass(frozen=True)
class MediaConfig:
    """Where media may come from and how much of it we accept.

    `allowed_media_domains` empty means any public host; listed hosts are the only ones
    fetched, and may resolve to private addresses. `decode_workers` 0 decodes in-process
    (tests, the offline API); > 0 decodes in that many worker processes started on first use.

    Decode memory is estimated from each image's header (`ImageHeader.decode_bytes`) before
    any pixel exists: `max_decode_bytes_per_request` caps the sum over one request's images
    (400), `max_inflight_decode_bytes` the sum over decoded images alive in the server (a
    decode waits up to `decode_wait_timeout_s` for room, then 503); 0 means no cap. A decode
    worker resident over `decode_worker_max_rss_bytes` (0: no limit) after a decode is retired.
    """

    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    fetch_timeout_s: float = 5.0
    max_fetch_bytes: int = 20 * 1024 * 1024
    max_redirects: int = 3
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    decode_workers: int = 0
    decode_timeout_s: float = 10.0
    max_decode_bytes_per_request: int = 1 << 30
    max_inflight_decode_bytes: int = 2 << 30
    decode_wait_timeout_s: float = 10.0
    decode_worker_max_rss_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "allowed_media_domains", tuple(d.lower() for d in self.allowed_media_domains)
        )
        for name in ("fetch_timeout_s", "decode_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_fetch_bytes", "max_image_pixels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_redirects < 0 or self.decode_workers < 0:
            raise ValueError("max_redirects and decode_workers must be >= 0")
        self._check_decode_fields()
        if self.allowed_local_media_path is not None:
            root = Path(self.allowed_local_media_path)
            if not root.is_absolute():
                raise ValueError(
                    "--allowed-local-media-path must be an absolute path, got "
                    f"{self.allowed_local_media_path!r}"
                )

    @property
    def decode_bytes_per_request_cap(self) -> int:
        """The per-request cap in force: a request can never use more than the in-flight cap."""
        return self.max_decode_bytes_per_request or self.max_inflight_decode_bytes

    def _check_decode_fields(self) -> None:
        for name in (
            "max_decode_bytes_per_request",
            "max_inflight_decode_bytes",
            "decode_worker_max_rss_bytes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no cap), got {getattr(self, name)}")
        if self.decode_wait_timeout_s <= 0:
            raise ValueError(
                f"decode_wait_timeout_s must be positive, got {self.decode_wait_timeout_s}"
            )
        per_request, inflight = self.max_decode_bytes_per_request, self.max_inflight_decode_bytes
        if inflight and per_request > inflight:
            # A request holds all its decoded images at once, so one over the server-wide cap
            # would wait for room that can never appear.
            raise ValueError(
                f"max_decode_bytes_per_request ({per_request}) must not exceed "
                f"max_inflight_decode_bytes ({inflight}); lower it or raise the in-flight cap"
            )


class MediaLoader:
    """Turns any supported media source into an RGB PIL image. Close it to stop decode workers."""

    def __init__(self, config: MediaConfig | None = None) -> None:
        self.config = config or MediaConfig()
        self._pool: DecodeWorkerPool | None = None
        self._pool_lock = threading.Lock()
        self.decode_gate = DecodeMemoryGate(
            self.config.max_inflight_decode_bytes, self.config.decode_wait_timeout_s
        )

    def load_image(
        self, source: MediaSource, budget: RequestDecodeBudget | None = None
    ) -> Image.Image:
        """`budget`: the request's decode budget (`new_decode_budget`); None: this image alone."""
        read = self._read_source(source)
        return read if isinstance(read, Image.Image) else self._decode(read, budget)

    async def aload_image(
        self, source: MediaSource, budget: RequestDecodeBudget | None = None
    ) -> Image.Image:
        """Fetch on a worker thread, then `adecode`: nothing blocks the event loop, and no
        thread waits for decode memory."""
        read = await asyncio.to_thread(self._read_source, source)
        return read if isinstance(read, Image.Image) else await self.adecode(read, budget)

    def _read_source(self, source: MediaSource) -> Image.Image | bytes:
        """An RGB image for a PIL source; the encoded bytes for every other kind."""
        if isinstance(source, Image.Image):
            return to_rgb(source)
        if isinstance(source, bytes | bytearray | memoryview):
            return bytes(source)
        if not isinstance(source, str):
            raise MediaError(
                f"unsupported image source of type {type(source).__name__}; pass a PIL image, "
                "bytes, or a data:, http(s):// or file:// URL"
            )
        scheme = source.split(":", 1)[0].lower() if ":" in source else ""
        if scheme == "data":
            return self._read_data_url(source)
        if scheme in ("http", "https"):
            cfg = self.config
            return fetch_url(
                source,
                allowed_domains=cfg.allowed_media_domains,
                timeout_s=cfg.fetch_timeout_s,
                max_bytes=cfg.max_fetch_bytes,
                max_redirects=cfg.max_redirects,
            )
        if scheme == "file":
            return self._read_file_url(source)
        raise MediaFetchRefusedError(
            "image URL must be a data:, http(s):// or (when enabled) file:// URL", param="image_url"
        )

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def __enter__(self) -> MediaLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def new_decode_budget(self) -> RequestDecodeBudget:
        """A fresh per-request decode-memory budget: pass one to every load of a request."""
        return RequestDecodeBudget(self.config.decode_bytes_per_request_cap)

    def _decode(self, data: bytes, budget: RequestDecodeBudget | None = None) -> Image.Image:
        """Decode on this thread; waiting for decode memory blocks it (see `adecode`)."""
        budget = budget if budget is not None else self.new_decode_budget()

        def admit(header: ImageHeader) -> Release:
            budget.charge(header.decode_bytes)
            return self.decode_gate.reserve(header.decode_bytes)

        return self._decode_admitted(data, admit)

    async def adecode(self, data: bytes, budget: RequestDecodeBudget | None = None) -> Image.Image:
        """Decode on a worker thread; when decode memory is short, wait on the event loop.

        A wait inside the thread would hold it (and a decode process) while the room it waits
        for is freed only by processing that needs threads too. So: read the header and, if
        the estimate fits now, decode at once; if not, give the thread and the worker back,
        await room (FIFO, bounded), then decode with the room already held.
        """
        budget = budget if budget is not None else self.new_decode_budget()

        def admit_if_room(header: ImageHeader) -> Release:
            budget.charge(header.decode_bytes)
            release = self.decode_gate.try_reserve(header.decode_bytes)
            if release is None:
                raise _NoRoomYet(header.decode_bytes)
            return release

        try:
            return await asyncio.to_thread(self._decode_admitted, data, admit_if_room)
        except _NoRoomYet as short:
            nbytes = short.nbytes
        release = await self.decode_gate.areserve(nbytes)

        def admit_reserved(header: ImageHeader) -> Release:
            assert header.decode_bytes == nbytes, "the same bytes gave another header"
            return release

        try:
            return await asyncio.to_thread(self._decode_admitted, data, admit_reserved)
        except BaseException:
            release()  # idempotent: a failed decode has given it back already
            raise

    def _decode_admitted(self, data: bytes, admit: Admit) -> Image.Image:
        cfg = self.config
        if cfg.decode_workers == 0:
            return decode_image_bytes(data, cfg.max_image_pixels, admit=admit)
        with self._pool_lock:
            if self._pool is None:
                self._pool = DecodeWorkerPool(
                    cfg.decode_workers, cfg.decode_timeout_s, cfg.decode_worker_max_rss_bytes
                )
            pool = self._pool
        return pool.decode(data, cfg.max_image_pixels, admit=admit)

    def _read_data_url(self, url: str) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep or not header.lower().endswith(";base64"):
            raise MediaError("data: URL must look like data:image/png;base64,<base64 data>")
        media_type = header[5:-7].strip().lower()
        if media_type and not media_type.startswith("image/"):
            raise MediaError(f"data: URL media type {media_type!r} is not an image type")
        if len(payload) * 3 // 4 > self.config.max_fetch_bytes:
            raise MediaFetchRefusedError(
                f"image is larger than the {self.config.max_fetch_bytes}-byte limit"
            )
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("data: URL payload is not valid base64") from None

    def _read_file_url(self, url: str) -> bytes:
        root = self.config.allowed_local_media_path
        if root is None:
            raise MediaFetchRefusedError(
                "file:// URLs are disabled; start the server with --allowed-local-media-path",
                param="image_url",
            )
        if "\\" in url or not url.isascii():
            raise MediaFetchRefusedError("file:// URL contains a backslash or non-ASCII character")
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise MediaFetchRefusedError("file:// URL must be file:///absolute/path")
        base = Path(root).resolve()
        try:
            path = Path(unquote(parts.path)).resolve(strict=True)
        except (OSError, RuntimeError):
            raise MediaError("file:// URL does not name a readable file") from None
        if not path.is_relative_to(base) or not path.is_file():
            raise MediaFetchRefusedError(
                "file:// URL is outside --allowed-local-media-path", param="image_url"
            )
        with path.open("rb") as f:
            data = f.read(self.config.max_fetch_bytes + 1)
        if len(data) > self.config.max_fetch_bytes:
            raise MediaFetchRefusedError(
                f"image is larger than the {self.config.max_fetch_bytes}-byte limit"
            )
        return data
