"""Media loading: PIL images, bytes, data: URLs, http(s) URLs and file:// paths -> RGB images."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from PIL import Image

from mmserve.processing.decode_budget import DecodeMemoryGate, Release, RequestDecodeBudget
from mmserve.processing.decode_workers import DecodeWorkerPool
from mmserve.processing.http_fetch import AsyncFetcher, FetchPolicy
from mmserve.processing.image_decode import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageHeader,
    decode_image_bytes,
    read_header,
)
from mmserve.processing.image_processor import ImageProcessorConfig
from mmserve.processing.media_source import MediaSource, read_media_source, url_scheme
from mmserve.processing.url_guard import AllowedHost, parse_allowlist
from mmserve.processing.video_decode import (
    DecodedVideo,
    VideoHeader,
    VideoLimits,
    decode_video_bytes,
)
from mmserve.processing.video_processor import VideoPlan
from mmserve.processing.video_sampling import VideoConfig
from mmserve.processing.video_worker import decode_video_in_worker

Reserve = Callable[[int], Release]  # reserve decode memory: blocking, or raising if no room
_Decoded = TypeVar("_Decoded")


class _NoRoomYet(Exception):
    """Raised from a decode's admit: its estimate does not fit the in-flight cap right now."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.nbytes = nbytes


@dataclass(frozen=True)
class MediaConfig:
    """Where media may come from and how much of it we accept.

    `allowed_media_domains` empty means any public host; listed `host` or `host:port` entries
    are the only ones fetched (a bare host on its scheme's default port only), and may resolve
    to private addresses. `max_concurrent_fetches` bounds the server's http(s) fetches in
    flight. `decode_workers` 0 decodes in-process (tests, the offline API); > 0 decodes in that
    many worker processes started on first use.

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
    max_concurrent_fetches: int = 16
    max_decode_bytes_per_request: int = 1 << 30
    max_inflight_decode_bytes: int = 2 << 30
    decode_wait_timeout_s: float = 10.0
    decode_worker_max_rss_bytes: int = 1 << 30
    # Video ceilings (docs/video.md): a request may lower the sampling, never these.
    max_video_bytes: int = 64 << 20
    max_video_seconds: float = 600.0
    max_video_frames_decoded: int = 36_000
    max_video_frame_pixels: int = 4096 * 2160
    max_video_decoded_pixels: int = 8 << 30
    video_decode_timeout_s: float = 30.0
    allowlist: tuple[AllowedHost, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        allowlist = parse_allowlist(self.allowed_media_domains)
        object.__setattr__(self, "allowlist", allowlist)
        object.__setattr__(self, "allowed_media_domains", tuple(str(e) for e in allowlist))
        if self.max_concurrent_fetches <= 0:
            raise ValueError(
                f"max_concurrent_fetches must be positive, got {self.max_concurrent_fetches}"
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
        if self.video_decode_timeout_s <= 0:
            raise ValueError(
                f"video_decode_timeout_s must be positive, got {self.video_decode_timeout_s}"
            )
        self.video_limits  # noqa: B018 - VideoLimits checks the video ceilings
        if self.allowed_local_media_path is not None:
            root = Path(self.allowed_local_media_path)
            if not root.is_absolute():
                raise ValueError(
                    "--allowed-local-media-path must be an absolute path, got "
                    f"{self.allowed_local_media_path!r}"
                )

    @property
    def fetch_policy(self) -> FetchPolicy:
        return FetchPolicy(
            allowlist=self.allowlist,
            timeout_s=self.fetch_timeout_s,
            max_bytes=self.max_fetch_bytes,
            max_redirects=self.max_redirects,
        )

    @property
    def video_limits(self) -> VideoLimits:
        return VideoLimits(
            max_bytes=self.max_video_bytes,
            max_duration_s=self.max_video_seconds,
            max_frames_walked=self.max_video_frames_decoded,
            max_frame_pixels=self.max_video_frame_pixels,
            max_decoded_pixels=self.max_video_decoded_pixels,
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
        self._fetcher = AsyncFetcher(self.config.fetch_policy, self.config.max_concurrent_fetches)
        self.decode_gate = DecodeMemoryGate(
            self.config.max_inflight_decode_bytes, self.config.decode_wait_timeout_s
        )

    def load_image(
        self, source: MediaSource, budget: RequestDecodeBudget | None = None
    ) -> Image.Image:
        """`budget`: the request's decode budget (`new_decode_budget`); None: this image alone."""
        read = self.read_source(source)
        return read if isinstance(read, Image.Image) else self._decode(read, budget)

    async def aload_image(
        self, source: MediaSource, budget: RequestDecodeBudget | None = None
    ) -> Image.Image:
        """http(s): fetched on the event loop in the bounded fetch pool. Anything else (data:,
        file://, bytes) is read on a worker thread that no fetch ever holds, so slow media
        servers cannot delay inline images. Then `adecode`: no thread waits for decode memory."""
        read = await self._aread(source, "image")
        return read if isinstance(read, Image.Image) else await self.adecode(read, budget)

    def read_source(self, source: MediaSource, what: str = "image") -> Image.Image | bytes:
        """An RGB image for a PIL source; the encoded bytes for every other kind. `what`:
        "image" or "video" (its byte cap, its data: media type, the field errors name)."""
        return read_media_source(
            source,
            what,
            max_bytes=self._max_bytes(what),
            fetch_policy=self.config.fetch_policy,
            allowed_local_media_path=self.config.allowed_local_media_path,
        )

    async def _aread(self, source: MediaSource, what: str) -> Image.Image | bytes:
        if isinstance(source, str) and url_scheme(source) in ("http", "https"):
            return await self._fetcher.fetch(source, self._max_bytes(what))
        return await asyncio.to_thread(self.read_source, source, what)

    def read_image_header(
        self, data: bytes, budget: RequestDecodeBudget | None = None
    ) -> ImageHeader:
        """The header of an image this server plans but does not decode (the encoder pool
        does): the pixel cap checked in a decode worker when there are any, the decode
        estimate charged to the request's budget, so the same 400s as a decode; no decode
        memory is reserved, since no pixel comes to exist here."""
        cfg = self.config
        if cfg.decode_workers == 0:
            header = read_header(data, cfg.max_image_pixels)[1]
        else:
            header = self._worker_pool().read_header(data, cfg.max_image_pixels)
        if budget is not None:
            budget.charge(header.decode_bytes)
        return header

    def _max_bytes(self, what: str) -> int:
        return self.config.max_video_bytes if what == "video" else self.config.max_fetch_bytes

    def load_video(
        self,
        source: MediaSource,
        cfg: VideoConfig,
        image_cfg: ImageProcessorConfig,
        budget: RequestDecodeBudget | None = None,
    ) -> DecodedVideo:
        """A video file's bytes (or a URL to them) -> its sampled frames, resized to the plan."""
        data = self.read_source(source, "video")
        assert isinstance(data, bytes)
        budget = budget if budget is not None else self.new_decode_budget()
        return self._decode_video(data, cfg, image_cfg, budget, self.decode_gate.reserve)

    async def aload_video(
        self,
        source: MediaSource,
        cfg: VideoConfig,
        image_cfg: ImageProcessorConfig,
        budget: RequestDecodeBudget | None = None,
    ) -> DecodedVideo:
        """`load_video` for the server: http(s) on the event loop, decoding on a thread, and
        a wait for decode memory on the event loop, as `adecode` does for images."""
        data = await self._aread(source, "video")
        assert isinstance(data, bytes)

        def decode(budget: RequestDecodeBudget, reserve: Reserve) -> DecodedVideo:
            return self._decode_video(data, cfg, image_cfg, budget, reserve)

        return await self._decode_when_room(decode, budget)

    def _decode_video(
        self,
        data: bytes,
        cfg: VideoConfig,
        image_cfg: ImageProcessorConfig,
        budget: RequestDecodeBudget,
        reserve: Reserve,
    ) -> DecodedVideo:
        def admit(header: VideoHeader, plan: VideoPlan) -> Release:
            nbytes = header.decode_bytes(plan)
            budget.charge(nbytes, what="video")
            return reserve(nbytes)

        limits = self.config.video_limits
        if self.config.decode_workers == 0:
            return decode_video_bytes(data, cfg, image_cfg, limits, admit=admit)
        return decode_video_in_worker(
            self._worker_pool(),
            data,
            cfg,
            image_cfg,
            limits,
            admit=admit,
            timeout_s=self.config.video_decode_timeout_s,
        )

    def close(self) -> None:
        self._fetcher.close()
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
        return self._decode_image(data, budget, self.decode_gate.reserve)

    async def adecode(self, data: bytes, budget: RequestDecodeBudget | None = None) -> Image.Image:
        """Decode on a worker thread; when decode memory is short, wait on the event loop."""

        def decode(budget: RequestDecodeBudget, reserve: Reserve) -> Image.Image:
            return self._decode_image(data, budget, reserve)

        return await self._decode_when_room(decode, budget)

    async def _decode_when_room(
        self,
        decode: Callable[[RequestDecodeBudget, Reserve], _Decoded],
        budget: RequestDecodeBudget | None,
    ) -> _Decoded:
        """Run `decode` on a worker thread without letting the thread wait for decode memory.

        A wait inside the thread would hold it (and a decode process) while the room it waits
        for is freed only by processing that needs threads too. So: read the header and, if
        the estimate fits now, decode at once; if not, give the thread and the worker back,
        await room (FIFO, bounded), then decode with the room already held.
        """
        budget = budget if budget is not None else self.new_decode_budget()

        def reserve_if_room(nbytes: int) -> Release:
            release = self.decode_gate.try_reserve(nbytes)
            if release is None:
                raise _NoRoomYet(nbytes)
            return release

        try:
            return await asyncio.to_thread(decode, budget, reserve_if_room)
        except _NoRoomYet as short:
            nbytes = short.nbytes
        release = await self.decode_gate.areserve(nbytes)
        uncharged = RequestDecodeBudget(0)  # the budget was charged by the first try

        def reserved(n: int) -> Release:
            assert n == nbytes, "the same bytes gave another header"
            return release

        try:
            return await asyncio.to_thread(decode, uncharged, reserved)
        except BaseException:
            release()  # idempotent: a failed decode has given it back already
            raise

    def _decode_image(
        self, data: bytes, budget: RequestDecodeBudget, reserve: Reserve
    ) -> Image.Image:
        def admit(header: ImageHeader) -> Release:
            budget.charge(header.decode_bytes)
            return reserve(header.decode_bytes)

        cfg = self.config
        if cfg.decode_workers == 0:
            return decode_image_bytes(data, cfg.max_image_pixels, admit=admit)
        return self._worker_pool().decode(data, cfg.max_image_pixels, admit=admit)

    def _worker_pool(self) -> DecodeWorkerPool:
        cfg = self.config
        with self._pool_lock:
            if self._pool is None:
                self._pool = DecodeWorkerPool(
                    cfg.decode_workers, cfg.decode_timeout_s, cfg.decode_worker_max_rss_bytes
                )
            return self._pool
