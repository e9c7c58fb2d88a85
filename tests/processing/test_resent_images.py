"""Images resent byte for byte are not decoded again while their processed form is cached,
and give exactly what a fresh decode gives; nothing else ever shares their entry."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmserve.errors import InvalidRequestError
from mmserve.hashing import Hasher
from mmserve.multimodal import ProcessedPrompt
from mmserve.processing.image_processor import ImageProcessorConfig
from mmserve.processing.input_processor import InputProcessor
from mmserve.processing.media import MediaLoader
from mmserve.processing.modalities import ProcessingConfig
from mmserve.processing.processor_cache import GIB, UUIDRecord
from mmserve.processing.resent_images import ResentImages
from mmserve.processing.video_sampling import VideoConfig
from tests.support.factory import random_image


def _png(image: Image.Image, compress_level: int = 6) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=compress_level)
    return out.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _messages(*urls: str, text: str = "what is this?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


class CountingLoader(MediaLoader):
    """A media loader that counts the images it decodes."""

    def __init__(self) -> None:
        super().__init__()
        self.decoded = 0

    async def adecode(self, data, budget=None):
        self.decoded += 1
        return await super().adecode(data, budget)


@pytest.fixture
def loader() -> CountingLoader:
    return CountingLoader()


def _processor(checkpoint: Path, loader: MediaLoader, **kwargs) -> InputProcessor:
    kwargs.setdefault("mm_processor_cache_gb", 0.05)
    return InputProcessor.from_pretrained(
        checkpoint, max_model_len=4096, media_loader=loader, **kwargs
    )


def _run(proc: InputProcessor, messages: list[dict], **kwargs) -> ProcessedPrompt:
    return asyncio.run(proc.aprocess_chat(messages, **kwargs))


def _same(a: ProcessedPrompt, b: ProcessedPrompt) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids
    assert [f.identifier for f in a.mm_features] == [f.identifier for f in b.mm_features]
    assert [f.grid_thw for f in a.mm_features] == [f.grid_thw for f in b.mm_features]
    assert np.array_equal(a.mrope_positions, b.mrope_positions)
    for f in a.mm_features:
        assert np.array_equal(
            a.mm_data[f.identifier].pixel_values, b.mm_data[f.identifier].pixel_values
        )


def test_a_resent_image_is_not_decoded_and_gives_what_a_decode_gives(
    tiny_checkpoint: Path, loader: CountingLoader
) -> None:
    first_url = _url(_png(random_image(96, 64, seed=1)))
    other_url = _url(_png(random_image(64, 96, seed=2)))
    proc = _processor(tiny_checkpoint, loader)
    first = _run(proc, _messages(first_url))
    assert loader.decoded == 1
    # the next turn resends the first image with a new one: only the new one is decoded
    second = _run(proc, _messages(first_url, other_url))
    assert loader.decoded == 2
    # a fresh server (nothing remembered) decodes both and names them the same
    fresh_loader = CountingLoader()
    fresh = _run(_processor(tiny_checkpoint, fresh_loader), _messages(first_url, other_url))
    assert fresh_loader.decoded == 2
    _same(second, fresh)
    assert second.mm_features[0].identifier == first.mm_features[0].identifier


def test_an_evicted_processed_form_is_decoded_again(
    tiny_checkpoint: Path, loader: CountingLoader
) -> None:
    url = _url(_png(random_image(96, 64, seed=3)))
    evicting_url = _url(_png(random_image(96, 64, seed=30)))
    probe = _processor(tiny_checkpoint, CountingLoader())
    _run(probe, _messages(url))
    one_entry = probe.cache.used_bytes
    # a cache with room for one of the two images: each evicts the other
    proc = _processor(tiny_checkpoint, loader, mm_processor_cache_gb=1.5 * one_entry / GIB)
    first = _run(proc, _messages(url))
    _run(proc, _messages(evicting_url))
    assert loader.decoded == 2 and len(proc.cache) == 1
    again = _run(proc, _messages(url))  # remembered, but its processed form was evicted
    assert loader.decoded == 3
    _same(first, again)
    _run(proc, _messages(url))  # and cached again: the next copy is not decoded
    assert loader.decoded == 3


def test_nothing_is_shared_across_namespaces_settings_or_other_bytes(
    tiny_checkpoint: Path, loader: CountingLoader
) -> None:
    image = random_image(96, 64, seed=4)
    url, same_pixels_url = _url(_png(image, 6)), _url(_png(image, 1))
    assert url != same_pixels_url
    proc = _processor(tiny_checkpoint, loader)
    base = _run(proc, _messages(url), namespace="tenant-a")
    _run(proc, _messages(url), namespace="tenant-b")
    assert loader.decoded == 2  # another namespace decodes for itself
    smaller = _run(
        proc,
        _messages(url),
        namespace="tenant-a",
        mm_processor_kwargs={"max_pixels": 28 * 28 * 4},
    )
    assert loader.decoded == 3  # other processor settings: other pixels, decoded again
    assert smaller.mm_features[0].identifier != base.mm_features[0].identifier
    again = _run(
        proc,
        _messages(url),
        namespace="tenant-a",
        mm_processor_kwargs={"max_pixels": 28 * 28 * 4},
    )
    assert loader.decoded == 3  # remembered under those settings too
    _same(again, smaller)
    assert smaller.mm_features[0].grid_thw != base.mm_features[0].grid_thw
    # other bytes of the same pixels are decoded, then share the pixels' processed form
    same_pixels = _run(proc, _messages(same_pixels_url), namespace="tenant-a")
    assert loader.decoded == 4
    assert same_pixels.mm_features[0].identifier == base.mm_features[0].identifier


def test_a_uuid_names_the_image_and_the_memo_stays_out_of_it(
    tiny_checkpoint: Path, loader: CountingLoader
) -> None:
    url = _url(_png(random_image(96, 64, seed=5)))
    proc = _processor(tiny_checkpoint, loader)
    parts = [{"type": "image_url", "image_url": {"url": url, "uuid": "shot-1"}}]
    messages = [{"role": "user", "content": parts}]
    _run(proc, messages)
    _run(proc, messages)
    assert loader.decoded == 2  # as before: a part with a uuid is decoded when it has data
    assert len(proc.items.resent) == 0


def test_undecodable_bytes_fail_every_time_and_are_never_remembered(
    tiny_checkpoint: Path, loader: CountingLoader
) -> None:
    url = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot a png").decode()
    proc = _processor(tiny_checkpoint, loader)
    for _ in range(2):
        with pytest.raises(InvalidRequestError):
            _run(proc, _messages(url))
    assert loader.decoded == 2 and len(proc.items.resent) == 0


def test_without_a_processor_cache_there_is_no_memo(
    tiny_checkpoint: Path, loader: CountingLoader
) -> None:
    url = _url(_png(random_image(96, 64, seed=6)))
    proc = _processor(tiny_checkpoint, loader, mm_processor_cache_gb=0)
    assert proc.items.resent is None and proc.resolver.resent is None
    _run(proc, _messages(url))
    _run(proc, _messages(url))
    assert loader.decoded == 2


def test_the_memo_is_bounded_and_forgets_the_least_recently_used() -> None:
    memo = ResentImages(Hasher())
    memo = ResentImages(Hasher(), capacity_bytes=2 * memo.entry_bytes("ns"))  # room for two
    cfg = ProcessingConfig(ImageProcessorConfig(), VideoConfig())
    record = UUIDRecord(width=4, height=4, mode="RGB")
    digests = [memo.digest(bytes([i])) for i in range(3)]
    memo.remember("ns", digests[0], cfg, record, "id-0")
    memo.remember("ns", digests[1], cfg, record, "id-1")
    assert memo.lookup("ns", digests[0], cfg) == (record, "id-0")  # now the most recent
    memo.remember("ns", digests[2], cfg, record, "id-2")
    assert len(memo) == 2
    assert memo.lookup("ns", digests[1], cfg) is None
    assert memo.lookup("ns", digests[0], cfg) == (record, "id-0")
    assert memo.lookup("other", digests[0], cfg) is None
