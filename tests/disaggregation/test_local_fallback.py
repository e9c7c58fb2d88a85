"""The local fallback: a RemoteItem's pixels made here exactly as the local path makes them."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from mmserve.config.media import MediaConfig
from mmserve.disaggregation.local_fallback import LocalFallback
from mmserve.disaggregation.protocol import content_digest
from mmserve.errors import InvalidRequestError, MediaFetchRefusedError
from mmserve.multimodal import RemoteItem
from mmserve.processing.image_processor import ImageProcessorConfig, get_grid_thw, process_image
from mmserve.processing.media import MediaLoader
from tests.support.factory import png_bytes
from tests.support.media_server import running_media_server

CFG = ImageProcessorConfig()
PNG = png_bytes(32, 24)
GRID = get_grid_thw(32, 24, CFG)


def _want() -> object:
    return process_image(Image.open(io.BytesIO(PNG)), CFG)


def _item(source: str, grid=GRID, *, url: str | None = None, digest: str | None = None):
    payload = None if source == "url" else PNG
    return RemoteItem(
        source,
        payload,
        url,
        None,
        CFG.min_pixels,
        CFG.max_pixels,
        grid,
        digest or content_digest(PNG),
    )


def test_file_bytes_become_the_pixels_the_local_path_makes():
    with MediaLoader() as media:
        got = LocalFallback(media, CFG).process(_item("bytes"))
    assert got.grid_thw == GRID
    assert (got.pixel_values == _want().pixel_values).all()


def test_the_items_own_pixel_bounds_apply():
    bounds = dict(min_pixels=28 * 28, max_pixels=28 * 28 * 2)  # 32x24 resized to one token
    small = ImageProcessorConfig(**bounds)
    item = RemoteItem("bytes", PNG, None, None, **bounds, grid_thw=get_grid_thw(32, 24, small),
                      content_digest=content_digest(PNG))  # fmt: skip
    assert item.grid_thw != GRID  # the server-wide bounds would give another grid
    with MediaLoader() as media:
        assert LocalFallback(media, CFG).process(item).grid_thw == item.grid_thw


def test_a_url_is_fetched_under_the_policy_and_must_be_the_planned_bytes():
    with running_media_server() as srv:
        allowed = MediaConfig(allowed_media_domains=(f"127.0.0.1:{srv.port}",))
        with MediaLoader(allowed) as media:
            fallback = LocalFallback(media, CFG)
            url = f"{srv.base}/img.png"
            got = fallback.process(_item("url", url=url))
            assert (got.pixel_values == _want().pixel_values).all()
            with pytest.raises(InvalidRequestError, match="changed since the request was planned"):
                fallback.process(_item("url", url=url, digest="0" * 64))
        with MediaLoader() as media, pytest.raises(MediaFetchRefusedError):
            LocalFallback(media, CFG).process(_item("url", url=f"{srv.base}/img.png"))


def test_a_grid_other_than_the_plan_fails_the_item():
    with MediaLoader() as media, pytest.raises(InvalidRequestError, match="planned as"):
        LocalFallback(media, CFG).process(_item("bytes", grid=(1, 8, 8)))
