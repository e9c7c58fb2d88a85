"""The local fallback: a remote item's CPU stage run on the language-model server itself.

When no encoder of the pool could encode an item (`--encoder-fallback local`), the LM server
still has the vision tower; it needs only the pixels. This does exactly what the local path
does for an image (decode in the isolated decode workers, URLs fetched under this server's URL
policy, the image processor with the item's own min/max pixels) and checks that the result is
the item the request was planned with: the same grid (its placeholder count) and, for a URL,
the same bytes (its identity was computed from their digest).
"""

from __future__ import annotations

import dataclasses

from PIL import Image

from mmserve.disaggregation.protocol import content_digest
from mmserve.errors import InvalidRequestError
from mmserve.multimodal import EncoderInput, RemoteItem
from mmserve.processing.http_fetch import fetch_url
from mmserve.processing.image_processor import ImageProcessorConfig, process_image
from mmserve.processing.media import MediaLoader


class LocalFallback:
    """RemoteItem -> EncoderInput, blocking: run it on a worker thread, never the engine's."""

    def __init__(self, media_loader: MediaLoader, image_config: ImageProcessorConfig) -> None:
        self.media_loader = media_loader
        self.image_config = image_config

    def process(self, item: RemoteItem) -> EncoderInput:
        """The item's pixels; InvalidRequestError (the input's fault) when it cannot be made
        or is not the image that was planned."""
        image = self._load(item)
        cfg = dataclasses.replace(
            self.image_config, min_pixels=item.min_pixels, max_pixels=item.max_pixels
        )
        processed = process_image(image, cfg)
        if tuple(processed.grid_thw) != tuple(item.grid_thw):
            raise InvalidRequestError(
                f"the image gives a {processed.grid_thw} patch grid here but was planned as "
                f"{item.grid_thw}; send it again",
                param="image_url",
            )
        return processed

    def close(self) -> None:
        self.media_loader.close()

    def _load(self, item: RemoteItem) -> Image.Image:
        if item.source == "rgb":
            assert item.payload is not None and item.rgb_size is not None
            width, height = item.rgb_size
            pixels = item.payload.reshape(height, width, 3)
            return Image.fromarray(pixels, mode="RGB")
        if item.source == "bytes":
            assert item.payload is not None
            return self.media_loader.load_image(item.payload.tobytes())
        assert item.url is not None
        data = fetch_url(item.url, self.media_loader.fetch_policy)
        if content_digest(data) != item.content_digest:
            raise InvalidRequestError(
                "the image at the URL changed since the request was planned (its bytes differ); "
                "send the request again",
                param="image_url",
            )
        return self.media_loader.load_image(data)
