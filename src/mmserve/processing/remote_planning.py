"""Remote mode of the CPU stage: images become `RemoteItem`s for the encoder pool, planned from
their header (inline bytes), their RGB array (offline pictures) or the pool's plan (http(s)),
never decoded here.

    source                         here                               RemoteItem.source
    data: URL, bytes, file://      header in a decode worker          "bytes" (the file)
    PIL image (offline)            to_rgb, packed uint8 [H, W, 3]     "rgb"
    http(s) URL                    UrlPlanner.plan (the pool fetches) "url"
      ... planner unavailable      the local path (fallback) or 503   (pixels, as before)

The grid is always our own smart_resize of the size (the same code the local path uses), so
placeholder counts are known before any embedding exists. Identity has its own hash domain
(`REMOTE_ITEM_DOMAIN`): a remote image can never share an identifier with a decoded one, and
two servers of one model name the same bytes planned to the same grid alike.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from PIL import Image

from mmserve.errors import EncoderUnavailableError
from mmserve.hashing import ContentKey, content_digest
from mmserve.multimodal import EncoderInput, RemoteItem
from mmserve.processing.decode_budget import RequestDecodeBudget
from mmserve.processing.image_processor import ImageProcessorConfig, get_grid_thw, to_rgb
from mmserve.processing.media import MediaLoader
from mmserve.processing.modalities import ImageModality, Modality, Planned, ProcessingConfig
from mmserve.processing.processor_cache import UUIDRecord
from mmserve.processing.url_planner import UrlPlan, UrlPlanner, UrlPlanUnavailable

REMOTE_ITEM_DOMAIN = "remote-image/v1"


@dataclass(frozen=True)
class RemoteImagePlanning:
    """How a disaggregated server plans images: http(s) URLs through `url_planner`; when it is
    unavailable, the local path (`fallback_local`: fetched and decoded here under this
    server's URL policy) or a 503 (--encoder-fallback fail)."""

    url_planner: UrlPlanner
    fallback_local: bool = True


@dataclass(frozen=True, slots=True)
class RemoteImage:
    """An image loaded for the encoder pool: its bytes (or URL) and its size, never pixels."""

    source: str  # "bytes" | "rgb" | "url", as RemoteItem.source
    payload: bytes | None  # the file, or the packed RGB array; None for "url"
    url: str | None
    width: int
    height: int
    content_digest: str  # blake3 hex of payload, or of the URL's bytes as the pool fetched them


@dataclass(frozen=True, slots=True)
class RemoteImageRecord:
    """What a UUID-only reference to a remote image keeps to plan it again (kwargs may differ)."""

    width: int
    height: int


@dataclass(frozen=True)
class RemoteImageModality:
    """The "image" modality of a disaggregated server: `RemoteImage`s are planned for the pool;
    decoded images (a URL that fell back to the local path, or a UUID first sent that way)
    keep the local modality's behaviour."""

    local: ImageModality
    name: str = "image"
    placeholder_token: str = "<|image_pad|>"
    record_type = (UUIDRecord, RemoteImageRecord)

    def record(self, item: Any) -> object:
        if isinstance(item, RemoteImage):
            return RemoteImageRecord(item.width, item.height)
        return self.local.record(item)

    def plan(self, record: object, cfg: ProcessingConfig) -> Planned:
        if not isinstance(record, RemoteImageRecord):
            return self.local.plan(record, cfg)
        # The decision is the local one (resized size, grid), not the raw min/max pixels: the
        # pool's pixels depend only on the image and the grid, so a cap that changes nothing
        # for this image changes nothing in its identity, as for local items.
        planned = self.local.plan(UUIDRecord(record.width, record.height, "RGB"), cfg)
        return replace(planned, domain=REMOTE_ITEM_DOMAIN)

    def fingerprint(self, cfg: ProcessingConfig) -> tuple[str | int, ...]:
        return self.local.fingerprint(cfg)

    def content_key(self, item: Any, namespace: str) -> ContentKey:
        if not isinstance(item, RemoteImage):
            return self.local.content_key(item, namespace)
        if item.source == "rgb":  # the digest covers the bytes, not how they are laid out
            return ("rgb", item.width, item.height, item.content_digest)
        return ("file", item.content_digest)  # inline bytes and a URL's bytes alike

    def process(
        self, item: Any, planned: Planned, cfg: ProcessingConfig
    ) -> EncoderInput | RemoteItem:
        if not isinstance(item, RemoteImage):
            return self.local.process(item, planned, cfg)
        return RemoteItem(
            source=item.source,
            payload=item.payload,
            url=item.url,
            rgb_size=(item.width, item.height) if item.source == "rgb" else None,
            min_pixels=cfg.image.min_pixels,
            max_pixels=cfg.image.max_pixels,
            grid_thw=planned.grid_thw,
            content_digest=item.content_digest,
        )


def remote_modalities(local: dict[str, Modality]) -> dict[str, Modality]:
    """The local modalities with images planned for the pool (videos stay local)."""
    image = local["image"]
    assert isinstance(image, ImageModality)
    return {**local, "image": RemoteImageModality(image)}


class RemoteImageLoader:
    """Loads image sources for the pool: what `MediaLoader.load_image` is to the local path.

    Returns a `RemoteImage`, or a decoded image when an http(s) URL took the local path.
    """

    def __init__(self, media_loader: MediaLoader, planning: RemoteImagePlanning) -> None:
        self.media_loader = media_loader
        self.planning = planning

    def load(
        self, source: Any, cfg: ImageProcessorConfig, budget: RequestDecodeBudget
    ) -> RemoteImage | Image.Image:
        """The offline API's path (LLM.generate / LLM.chat): a URL plan runs on an event loop."""
        if _is_http(source):
            plan = _run_coroutine(self._plan(source, cfg))
            if plan is None:
                return self.media_loader.load_image(source, budget)
            return _from_plan(source, plan)
        if isinstance(source, Image.Image):
            return from_pil(source)
        return self._from_bytes(self.media_loader.read_source(source), budget)

    async def aload(
        self, source: Any, cfg: ImageProcessorConfig, budget: RequestDecodeBudget
    ) -> RemoteImage | Image.Image:
        """The server's path: the plan awaited here, reading and the header off the loop."""
        if _is_http(source):
            plan = await self._plan(source, cfg)
            if plan is None:
                return await self.media_loader.aload_image(source, budget)
            return _from_plan(source, plan)
        return await asyncio.to_thread(self.load, source, cfg, budget)

    def _from_bytes(self, read: Image.Image | bytes, budget: RequestDecodeBudget) -> RemoteImage:
        if isinstance(read, Image.Image):
            return from_pil(read)
        header = self.media_loader.read_image_header(read, budget)
        return RemoteImage("bytes", read, None, header.width, header.height, content_digest(read))

    async def _plan(self, url: str, cfg: ImageProcessorConfig) -> UrlPlan | None:
        """The pool's plan, checked against our own; None: take the local path."""
        try:
            plan = await self.planning.url_planner.plan(
                url, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels
            )
            _check_plan(plan, cfg)
        except UrlPlanUnavailable as e:
            if self.planning.fallback_local:
                return None
            raise EncoderUnavailableError(
                f"no encoder could plan the image URL ({e}) and this server does not fall "
                "back to its own vision stage (--encoder-fallback fail); retry shortly",
                param="image_url",
            ) from None
        return plan


def from_pil(image: Image.Image) -> RemoteImage:
    """An offline picture as the local path would see it (to_rgb), packed uint8 [H, W, 3]."""
    rgb = to_rgb(image)
    payload = rgb.tobytes()
    return RemoteImage("rgb", payload, None, rgb.width, rgb.height, content_digest(payload))


def _from_plan(url: str, plan: UrlPlan) -> RemoteImage:
    return RemoteImage("url", None, url, plan.width, plan.height, plan.content_digest)


def _check_plan(plan: UrlPlan, cfg: ImageProcessorConfig) -> None:
    """An answer that disagrees with our own planning is the pool's fault, not the request's:
    treated as no answer (fallback or 503). A size the local path refuses (aspect ratio)
    raises here exactly as it would there."""
    digest = plan.content_digest
    if not (len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
        raise UrlPlanUnavailable(
            f"the encoder's plan has content digest {digest!r}, not blake3 hex"
        )
    if plan.width <= 0 or plan.height <= 0:
        raise UrlPlanUnavailable(f"the encoder planned a {plan.width}x{plan.height} image")
    ours = get_grid_thw(plan.width, plan.height, cfg)
    if tuple(plan.grid_thw) != ours:
        raise UrlPlanUnavailable(
            f"the encoder planned grid {tuple(plan.grid_thw)} for a {plan.width}x{plan.height} "
            f"image, this server plans {ours} (do both run the same checkpoint?)"
        )


def _is_http(source: Any) -> bool:
    return isinstance(source, str) and source.split(":", 1)[0].lower() in ("http", "https")


def _run_coroutine(coro: Any) -> Any:
    """Run a coroutine to completion from synchronous code: on a fresh loop on this thread, or
    on a helper thread's when this thread already runs one (e.g. LLM.chat in a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()
