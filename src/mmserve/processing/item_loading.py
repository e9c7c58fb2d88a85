"""Loading a prompt's items: images (local or planned for the encoder pool) and videos."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

from PIL import Image

from mmserve.processing.chat import ChatImage
from mmserve.processing.decode_budget import RequestDecodeBudget
from mmserve.processing.media import MediaLoader
from mmserve.processing.modalities import ProcessingConfig
from mmserve.processing.remote_planning import RemoteImage, RemoteImageLoader
from mmserve.processing.resent_images import EncodedImage, ResentImages, SourcedImage
from mmserve.processing.video_decode import DecodedVideo
from mmserve.processing.video_inputs import offline_video

# None: a UUID-only reference to an image sent before; RemoteImage: planned for the encoder pool
ImageInput = Image.Image | RemoteImage | None
VideoInput = DecodedVideo | None  # None: a UUID-only reference to a video sent before


class ItemLoader:
    """Loads each item with the request's decode budget: on the calling thread (offline), or
    concurrently on the event loop (the server)."""

    def __init__(
        self,
        media_loader: MediaLoader,
        remote_loader: RemoteImageLoader | None,
        resent: ResentImages | None = None,
    ) -> None:
        """`remote_loader`: a disaggregated server's images are planned, not decoded.
        `resent`: the server's images sent again byte for byte are not decoded again
        (processing/resent_images.py)."""
        self.media_loader = media_loader
        self.remote_loader = remote_loader
        self.resent = resent

    def load_image(
        self, image: Any, cfg: ProcessingConfig, budget: RequestDecodeBudget
    ) -> ImageInput:
        if image is None:
            return None
        if self.remote_loader is not None:
            return self.remote_loader.load(image, cfg.image, budget)
        if isinstance(image, Image.Image):
            return image  # PIL: hashed as given (mode, size, pixels, EXIF id)
        return self.media_loader.load_image(image, budget)

    def load_part(self, part: ChatImage, cfg: ProcessingConfig, budget: RequestDecodeBudget) -> Any:
        if part.source is None:
            return None
        if part.modality == "video":
            return offline_video(part.source, self.media_loader, cfg, budget)
        return self.load_image(part.source, cfg, budget)

    async def aread_parts(
        self, parts: Sequence[ChatImage], cfg: ProcessingConfig, budget: RequestDecodeBudget
    ) -> list[Any]:
        """The server's first phase, I/O: every item's bytes (http(s) fetched, data: and file
        media read; a disaggregated server's images planned for the pool), concurrently.
        `adecode_parts` then does the CPU work, in the request's processing turn."""
        return await _all_or_none([self._aread_part(part, cfg, budget) for part in parts])

    async def adecode_parts(
        self,
        parts: Sequence[ChatImage],
        reads: Sequence[Any],
        cfg: ProcessingConfig,
        budget: RequestDecodeBudget,
        namespace: str,
    ) -> list[Any]:
        """The second phase, CPU: `aread_parts`' bytes decoded, concurrently.

        An image whose bytes were decoded before (same namespace and settings) comes back as
        an `EncodedImage`, any other decoded one as a `SourcedImage` (with `resent`)."""
        return await _all_or_none(
            [
                self._adecode_part(part, read, cfg, budget, namespace)
                for part, read in zip(parts, reads, strict=True)
            ]
        )

    async def adecode_resent(self, loaded: list[Any], budget: RequestDecodeBudget) -> list[Any]:
        """`loaded` with every `EncodedImage` decoded (its processed form was evicted)."""

        async def decoded(item: Any) -> Any:
            if not isinstance(item, EncodedImage):
                return item
            return SourcedImage(await self.media_loader.adecode(item.data, budget), item.digest)

        return await _all_or_none([decoded(item) for item in loaded])

    async def _aread_part(
        self, part: ChatImage, cfg: ProcessingConfig, budget: RequestDecodeBudget
    ) -> Any:
        if part.source is None:
            return None
        if part.modality == "video":
            return await self.media_loader.aread(part.source, "video")
        if self.remote_loader is not None:
            return await self.remote_loader.aload(part.source, cfg.image, budget)
        return await self.media_loader.aread(part.source, "image")

    async def _adecode_part(
        self,
        part: ChatImage,
        read: Any,
        cfg: ProcessingConfig,
        budget: RequestDecodeBudget,
        namespace: str,
    ) -> Any:
        loader = self.media_loader
        if not isinstance(read, bytes):  # nothing to decode: None, a PIL image, a pool plan
            return read
        if part.modality == "video":
            return await loader.adecode_video(read, cfg.video, cfg.image, budget)
        if self.resent is None or part.uuid is not None:  # a uuid names the image itself
            return await loader.adecode(read, budget)
        digest = await asyncio.to_thread(self.resent.digest, read)
        known = self.resent.lookup(namespace, digest, cfg)
        if known is not None:
            return EncodedImage(read, digest, *known)
        return SourcedImage(await loader.adecode(read, budget), digest)


async def _all_or_none(coros: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Every result, concurrently; when one fails, the others stop (their fetch slots and
    decode threads serve other requests instead of a request that already failed)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
