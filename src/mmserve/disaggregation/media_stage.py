"""The encoder's CPU stage: an item's media bytes (sent, fetched, or kept from a plan) -> its
patches, under the same URL policy and decode limits as `serve`, with the same error messages.

    EncodeItem ──read──> bytes ──digest/key──> (cache?) ──decode + process──> EncoderInput
    plan(url)  ──fetch──> bytes ──keep by digest──> header size ──smart_resize──> grid
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import blake3
from PIL import Image

from mmserve.disaggregation.embedding_cache import ByteBudgetLRU
from mmserve.disaggregation.protocol import EncodeItem, content_digest
from mmserve.errors import (
    DecodeBusyError,
    InvalidRequestError,
    MediaError,
    MediaFetchBusyError,
    MediaFetchRefusedError,
)
from mmserve.multimodal import EncoderInput
from mmserve.processing.http_fetch import AsyncFetcher
from mmserve.processing.image_processor import ImageProcessorConfig, get_grid_thw, process_image
from mmserve.processing.media import MediaLoader
from mmserve.processing.url_planner import UrlPlan

# Fetched URL bytes are kept this long (and within PLAN_STORE_BYTES) for the encode that
# follows a plan; after that the encode fetches again (and checks the digest).
PLAN_STORE_BYTES = 256 << 20
PLAN_STORE_TTL_S = 120.0
_KEY_DOMAIN = b"mmserve-encoder-content-v1"


class ItemError(Exception):
    """An item this encoder cannot encode: `code` is one of protocol.ERROR_CODES."""

    def __init__(self, code: str, message: str, param: str | None = "image_url") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def content_key(item: EncodeItem, digest: str) -> str:
    """The encoder's own key of an item: what it computed over the bytes plus the decision.
    Never the client's identifier, so no client can name (or poison) another's entry."""
    h = blake3.blake3(_KEY_DOMAIN)
    h.update(f"\0{item.source}\0{item.rgb_size}\0{digest}\0".encode())
    h.update(f"{item.min_pixels}\0{item.max_pixels}\0{tuple(item.grid_thw)}".encode())
    return h.hexdigest()


def _plan_key(url: str, digest: str) -> str:
    """Kept bytes answer only an encode of the URL that was planned, with the planned digest."""
    return f"{digest}\0{url}"


class MediaStage:
    """Reads, decodes and processes items off the event loop: decoding in the loader's worker
    processes, processing on a bounded pool of `num_threads` threads."""

    def __init__(
        self, media: MediaLoader, image_config: ImageProcessorConfig, num_threads: int
    ) -> None:
        self.media = media
        self.image_config = image_config
        policy = media.fetch_policy
        self._fetcher = AsyncFetcher(policy, media.config.max_concurrent_media_fetches)
        self._plans: ByteBudgetLRU[bytes] = ByteBudgetLRU(PLAN_STORE_BYTES, PLAN_STORE_TTL_S)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="mmserve-encode-cpu")

    def close(self) -> None:
        self._fetcher.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.media.close()

    @property
    def plan_store_bytes(self) -> int:
        return self._plans.num_bytes

    def config_for(self, min_pixels: int, max_pixels: int) -> ImageProcessorConfig:
        try:
            return self.image_config.with_overrides(
                {"min_pixels": min_pixels, "max_pixels": max_pixels}
            )
        except InvalidRequestError as exc:
            raise ItemError("bad_request", exc.message, exc.param) from None

    async def read(self, item: EncodeItem, payload: bytes) -> bytes:
        """The item's media bytes: its payload, or its URL's bytes (kept from a plan, or
        fetched now). Raises ItemError."""
        if item.source != "url":
            return payload
        assert item.url is not None
        kept = self._plans.get(_plan_key(item.url, item.content_digest))
        return kept if kept is not None else await self._fetch(item.url)

    async def process(self, item: EncodeItem, data: bytes) -> EncoderInput:
        """Decode (file bytes) or wrap (RGB) the image and turn it into patches, as the local
        path does; the grid must be the item's. Raises ItemError."""
        cfg = self.config_for(item.min_pixels, item.max_pixels)
        try:
            if item.rgb_size is not None:
                image = self._rgb_image(data, item.rgb_size)
            else:
                image = await self.media.adecode(data)
            loop = asyncio.get_running_loop()
            processed = await loop.run_in_executor(self._pool, process_image, image, cfg)
        except (DecodeBusyError, MediaFetchBusyError) as exc:
            raise ItemError("overloaded", exc.message, exc.param) from None
        except InvalidRequestError as exc:
            raise ItemError("invalid_image", exc.message, exc.param or "image_url") from None
        if tuple(processed.grid_thw) != tuple(item.grid_thw):
            raise ItemError(
                "grid_mismatch",
                f"the encoder's grid {tuple(processed.grid_thw)} for image item "
                f"{item.item_index} differs from the planned {tuple(item.grid_thw)}: the two "
                "servers do not process images alike (model or processor config)",
            )
        return processed

    async def plan(self, url: str, min_pixels: int, max_pixels: int) -> UrlPlan:
        """Fetch `url` under the policy, keep its bytes by digest, and plan its grid from the
        image header (no pixel decoded). Raises ItemError."""
        cfg = self.config_for(min_pixels, max_pixels)
        data = await self._fetch(url)
        digest = content_digest(data)
        try:
            # in a decode worker when the server has them (a header parser can crash too)
            header = await asyncio.to_thread(self.media.read_image_header, data)
            grid = get_grid_thw(header.width, header.height, cfg)
        except InvalidRequestError as exc:
            raise ItemError("invalid_image", exc.message, exc.param or "image_url") from None
        self._plans.put(_plan_key(url, digest), data, len(data))
        return UrlPlan(digest, header.width, header.height, grid)

    async def _fetch(self, url: str) -> bytes:
        if url.split(":", 1)[0].lower() not in ("http", "https"):
            raise ItemError(
                "fetch_refused",
                "an encoder fetches only http(s):// image URLs; data: and file:// images are "
                "sent to it as bytes",
            )
        try:
            return await self._fetcher.fetch(url)
        except MediaFetchBusyError as exc:
            raise ItemError("overloaded", exc.message, exc.param) from None
        except MediaFetchRefusedError as exc:
            raise ItemError("fetch_refused", exc.message, exc.param) from None
        except MediaError as exc:
            raise ItemError("fetch_failed", exc.message, exc.param) from None

    def _rgb_image(self, data: bytes, size: tuple[int, int]) -> Image.Image:
        width, height = size
        max_pixels = self.media.config.image_pixel_cap
        if width * height > max_pixels:
            raise MediaError(
                f"the image is {width}x{height} = {width * height} pixels, over the "
                f"{max_pixels}-pixel limit (--max-image-pixels); downscale it before sending",
                param="image_url",
            )
        return Image.frombytes("RGB", (width, height), data)
