"""Loading a prompt's items: images (local or planned for the encoder pool) and videos."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from PIL import Image

from mmserve.processing.chat import ChatImage
from mmserve.processing.decode_budget import RequestDecodeBudget
from mmserve.processing.media import MediaLoader
from mmserve.processing.modalities import ProcessingConfig
from mmserve.processing.remote_planning import RemoteImage, RemoteImageLoader
from mmserve.processing.video_decode import DecodedVideo
from mmserve.processing.video_inputs import offline_video

# None: a UUID-only reference to an image sent before; RemoteImage: planned for the encoder pool
ImageInput = Image.Image | RemoteImage | None
VideoInput = DecodedVideo | None  # None: a UUID-only reference to a video sent before


class ItemLoader:
    """Loads each item with the request's decode budget: on the calling thread (offline), or
    concurrently on the event loop (the server)."""

    def __init__(self, media_loader: MediaLoader, remote_loader: RemoteImageLoader | None) -> None:
        """`remote_loader`: a disaggregated server's images are planned, not decoded."""
        self.media_loader = media_loader
        self.remote_loader = remote_loader

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

    async def aload_parts(
        self, parts: Sequence[ChatImage], cfg: ProcessingConfig, budget: RequestDecodeBudget
    ) -> list[Any]:
        """Load every item concurrently; when one fails, stop the others (their fetch slots
        and decode threads serve other requests instead of a request that already failed)."""
        tasks = [asyncio.ensure_future(self._aload_part(part, cfg, budget)) for part in parts]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _aload_part(
        self, part: ChatImage, cfg: ProcessingConfig, budget: RequestDecodeBudget
    ) -> Any:
        loader = self.media_loader
        if part.source is None:
            return None
        if part.modality == "video":
            return await loader.aload_video(part.source, cfg.video, cfg.image, budget)
        if self.remote_loader is not None:
            return await self.remote_loader.aload(part.source, cfg.image, budget)
        return await loader.aload_image(part.source, budget)
