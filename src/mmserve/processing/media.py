"""Media loading: PIL images, bytes, data: URLs, http(s) URLs and file:// paths -> RGB images."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

from PIL import Image

from mmserve.config.media import MediaConfig
from mmserve.processing.decode_budget import DecodeMemoryGate, Release, RequestDecodeBudget
from mmserve.processing.decode_workers import DecodeWorkerPool
from mmserve.processing.http_fetch import AsyncFetcher, FetchPolicy
from mmserve.processing.image_decode import (
    ImageHeader,
    decode_image_bytes,
    read_header,
)
from mmserve.processing.image_processor import ImageProcessorConfig
from mmserve.processing.media_source import MediaSource, read_media_source, url_scheme
from mmserve.processing.video_decode import DecodedVideo, VideoHeader, decode_video_bytes
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


class MediaLoader:
    """Turns any supported media source into an RGB PIL image. Close it to stop decode workers."""

    def __init__(self, config: MediaConfig | None = None) -> None:
        self.config = config or MediaConfig()
        self._pool: DecodeWorkerPool | None = None
        self._pool_lock = threading.Lock()
        self.fetch_policy = _fetch_policy(self.config)
        self._fetcher = AsyncFetcher(self.fetch_policy, self.config.max_concurrent_media_fetches)
        self.decode_gate = DecodeMemoryGate(
            self.config.max_inflight_decode_bytes, self.config.decode_wait_timeout
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
        read = await self.aread(source, "image")
        return read if isinstance(read, Image.Image) else await self.adecode(read, budget)

    def read_source(self, source: MediaSource, what: str = "image") -> Image.Image | bytes:
        """An RGB image for a PIL source; the encoded bytes for every other kind. `what`:
        "image" or "video" (its byte cap, its data: media type, the field errors name)."""
        return read_media_source(
            source,
            what,
            max_bytes=self._max_bytes(what),
            fetch_policy=self.fetch_policy,
            allowed_local_media_path=self.config.allowed_local_media_path,
        )

    async def aread(self, source: MediaSource, what: str) -> Image.Image | bytes:
        """`read_source` for the server: http(s) fetched on the event loop in the bounded
        fetch pool, anything else read on a worker thread."""
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
            header = read_header(data, cfg.image_pixel_cap)[1]
        else:
            header = self._worker_pool().read_header(data, cfg.image_pixel_cap)
        if budget is not None:
            budget.charge(header.decode_bytes)
        return header

    def _max_bytes(self, what: str) -> int:
        return self.config.max_video_bytes if what == "video" else self.config.max_media_bytes

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

    async def adecode_video(
        self,
        data: bytes,
        cfg: VideoConfig,
        image_cfg: ImageProcessorConfig,
        budget: RequestDecodeBudget | None = None,
    ) -> DecodedVideo:
        """`load_video` for the server, once `aread` has the bytes: decoding on a thread, and
        a wait for decode memory on the event loop, as `adecode` does for images."""

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
            timeout_s=self.config.video_decode_timeout,
        )

    def start_decode_workers(self) -> threading.Thread | None:
        """Start the decode workers now, on a thread of their own (None: this loader decodes
        in-process): a server's first images then find them ready (`start_workers`)."""
        if self.config.decode_workers == 0:
            return None
        thread = threading.Thread(
            target=self._worker_pool().start_workers, name="decode-workers-start", daemon=True
        )
        thread.start()
        return thread

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
            return decode_image_bytes(data, cfg.image_pixel_cap, admit=admit)
        return self._worker_pool().decode(data, cfg.image_pixel_cap, admit=admit)

    def _worker_pool(self) -> DecodeWorkerPool:
        cfg = self.config
        with self._pool_lock:
            if self._pool is None:
                self._pool = DecodeWorkerPool(
                    cfg.decode_workers, cfg.decode_timeout_s, cfg.decode_worker_max_rss_mb << 20
                )
            return self._pool


def _fetch_policy(config: MediaConfig) -> FetchPolicy:
    return FetchPolicy(
        allowlist=config.allowlist,
        timeout_s=config.media_fetch_timeout,
        max_bytes=config.max_media_bytes,
        max_redirects=config.max_redirects,
    )
