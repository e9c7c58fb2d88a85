"""Shared pieces of the remote-mode tests: encoded images, chat messages, an in-process
UrlPlanner and a MediaLoader whose http(s) fetches are answered from a dict (no sockets)."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import blake3
import numpy as np
from PIL import Image

from mmserve.config.media import MediaConfig
from mmserve.errors import MediaFetchRefusedError
from mmserve.multimodal import EncoderInput, ProcessedPrompt
from mmserve.processing.image_decode import read_header
from mmserve.processing.image_processor import ImageProcessorConfig, get_grid_thw
from mmserve.processing.input_processor import InputProcessor
from mmserve.processing.media import MediaLoader
from mmserve.processing.remote_planning import RemoteImagePlanning
from mmserve.processing.url_planner import UrlPlan, UrlPlanUnavailable
from tests.support.factory import random_image

ONE_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>describe"
CAT_URL = "https://images.example/cat.png"


def encoded(image: Image.Image, fmt: str = "PNG", **save: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return buf.getvalue()


def rotated_jpeg(width: int, height: int, orientation: int) -> bytes:
    """A JPEG whose EXIF says "display rotated": stored width x height, as phones write them."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encoded(random_image(width, height, seed=width), "JPEG", exif=exif.tobytes())


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(*urls: str, uuids: tuple[str | None, ...] = ()) -> list[dict]:
    parts: list[dict] = []
    for i, url in enumerate(urls):
        uuid = uuids[i] if i < len(uuids) else None
        image_url = {"url": url} if uuid is None else {"url": url, "uuid": uuid}
        parts.append({"type": "image_url", "image_url": image_url})
    parts.append({"type": "text", "text": "Which shapes?"})
    return [{"role": "user", "content": parts}]


class FakePlanner:
    """An in-process encoder pool's plan RPC: answers from the bytes it holds for each URL the
    way an encoder plans them (header, blake3, our smart_resize), or fails as told."""

    def __init__(self, pages: dict[str, bytes], image_config: ImageProcessorConfig) -> None:
        self.pages = pages
        self.image_config = image_config
        self.mode = "answer"  # "answer" | "refuse" | "unavailable" | "wrong_grid"
        self.calls: list[tuple[str, int, int]] = []

    async def plan(self, url: str, *, min_pixels: int, max_pixels: int) -> UrlPlan:
        self.calls.append((url, min_pixels, max_pixels))
        await asyncio.sleep(0)
        if self.mode == "refuse":
            raise MediaFetchRefusedError("image URL host is not allowed", param="image_url")
        if self.mode == "unavailable":
            raise UrlPlanUnavailable("no healthy encoder")
        data = self.pages[url]
        _, header = read_header(data, 1 << 40)
        cfg = self.image_config.with_overrides({"min_pixels": min_pixels, "max_pixels": max_pixels})
        t, h, w = get_grid_thw(header.width, header.height, cfg)
        grid = (t, h + 2, w) if self.mode == "wrong_grid" else (t, h, w)
        return UrlPlan(blake3.blake3(data).hexdigest(), header.width, header.height, grid)


class PagesMediaLoader(MediaLoader):
    """A MediaLoader whose http(s) "fetches" are answered from a dict: no socket in the tests."""

    def __init__(self, pages: dict[str, bytes], config: MediaConfig | None = None) -> None:
        super().__init__(config)
        self.pages = pages

    def read_source(self, source, what: str = "image"):
        if isinstance(source, str) and source.startswith("http"):
            return self.pages[source]
        return super().read_source(source, what)

    async def aload_image(self, source, budget=None):
        if isinstance(source, str) and source.startswith("http"):
            return await self.adecode(self.pages[source], budget)
        return await super().aload_image(source, budget)


PAGES = {CAT_URL: encoded(random_image(120, 90, seed=11))}


def make_processor(
    model_dir: Path, root: Path, planner: FakePlanner | None, **config: object
) -> InputProcessor:
    loader = PagesMediaLoader(PAGES, MediaConfig(allowed_local_media_path=str(root), **config))
    proc = InputProcessor.from_pretrained(
        model_dir,
        max_model_len=8192,
        mm_processor_cache_gb=0.05,
        media_loader=loader,
        remote_images=None if planner is None else RemoteImagePlanning(planner),
    )
    return proc


def make_planner(model_dir: Path) -> FakePlanner:
    return FakePlanner(PAGES, ImageProcessorConfig.from_pretrained(model_dir))


def refuse_decode(img: Image.Image) -> Image.Image:
    """Stands in for the decoder where a test proves that nothing is decoded."""
    raise AssertionError("a remote-mode request decoded an image")


def same_plan(got: ProcessedPrompt, want: ProcessedPrompt) -> None:
    """`got` (remote) plans exactly what `want` (the local path, with pixels) processed."""
    assert got.prompt_token_ids == want.prompt_token_ids
    np.testing.assert_array_equal(got.mrope_positions, want.mrope_positions)
    assert got.mrope_position_delta == want.mrope_position_delta
    for g, w in zip(got.mm_features, want.mm_features, strict=True):
        assert (g.placeholder, g.grid_thw) == (w.placeholder, w.grid_thw)
        w_data = want.mm_data[w.identifier]
        assert isinstance(w_data, EncoderInput) and w_data.grid_thw == g.grid_thw
