"""Remote mode of the input processor: images planned for the encoder pool, never decoded here,
with the local processor as the oracle for grids, placeholder counts, positions and errors."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from pathlib import Path

import blake3
import numpy as np
import pytest
from PIL import Image

from mmserve.errors import (
    EncoderUnavailableError,
    ImageDecodeError,
    ImageTooLargeError,
    InvalidRequestError,
    MediaFetchRefusedError,
    TooManyItemsError,
    UnknownMediaUUIDError,
)
from mmserve.multimodal import ProcessedImage, ProcessedPrompt, RemoteItem
from mmserve.processing import image_decode
from mmserve.processing.image_decode import read_header
from mmserve.processing.image_processor import ImageProcessorConfig, get_grid_thw, to_rgb
from mmserve.processing.input_processor import InputProcessor
from mmserve.processing.media import MediaConfig, MediaLoader
from mmserve.processing.remote_items import RemoteImagePlanning
from mmserve.processing.url_planner import UrlPlan, UrlPlanUnavailable
from tests.factory import flat_png, random_image, video_frames

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


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("media")


def _processor(
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


def _planner(model_dir: Path) -> FakePlanner:
    return FakePlanner(PAGES, ImageProcessorConfig.from_pretrained(model_dir))


@pytest.fixture(scope="module")
def planner(qwen2_vl_dir: Path) -> FakePlanner:
    return _planner(qwen2_vl_dir)


@pytest.fixture(scope="module")
def local(qwen2_vl_dir: Path, media_root: Path) -> Iterator[InputProcessor]:
    proc = _processor(qwen2_vl_dir, media_root, None)
    yield proc
    proc.media_loader.close()


@pytest.fixture(scope="module")
def remote(qwen2_vl_dir: Path, media_root: Path, planner: FakePlanner) -> Iterator[InputProcessor]:
    proc = _processor(qwen2_vl_dir, media_root, planner)
    yield proc
    proc.media_loader.close()


@pytest.fixture
def fresh_planner(planner: FakePlanner) -> Iterator[FakePlanner]:
    planner.mode = "answer"
    planner.calls.clear()
    yield planner
    planner.mode = "answer"


def _refuse_decode(img: Image.Image) -> Image.Image:
    raise AssertionError("a remote-mode request decoded an image")


@pytest.fixture
def no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any image decode in this process fails the test (remote planning reads headers only)."""
    monkeypatch.setattr(image_decode, "decode_first_frame", _refuse_decode)


def _same_plan(got: ProcessedPrompt, want: ProcessedPrompt) -> None:
    assert got.prompt_token_ids == want.prompt_token_ids
    np.testing.assert_array_equal(got.mrope_positions, want.mrope_positions)
    assert got.mrope_position_delta == want.mrope_position_delta
    for g, w in zip(got.mm_features, want.mm_features, strict=True):
        assert (g.placeholder, g.grid_thw) == (w.placeholder, w.grid_thw)
        assert isinstance(w.data, ProcessedImage) and w.data.grid_thw == g.grid_thw


# ------------------------------------------------------------- plans equal the local path's

FIXED_AREA = {"min_pixels": 6272, "max_pixels": 6272}
CASES = {
    "rgb png": (encoded(random_image(100, 80, seed=1)), None),
    "one pixel": (encoded(random_image(1, 1, seed=2)), None),
    "thin strip": (encoded(random_image(5, 300, seed=3)), None),
    "wide strip": (encoded(random_image(390, 2, seed=4)), None),
    "odd sizes": (encoded(random_image(57, 301, seed=5)), {"max_pixels": 20_000}),
    "rgba png": (encoded(random_image(64, 48, seed=6, mode="RGBA")), None),
    "palette png": (encoded(random_image(70, 50, seed=7).convert("P")), None),
    "gif": (encoded(random_image(40, 90, seed=8).convert("P"), "GIF"), None),
    "webp": (encoded(random_image(90, 33, seed=9), "WEBP"), None),
    "bmp": (encoded(random_image(31, 29, seed=10), "BMP"), None),
    "jpeg rotated 90": (rotated_jpeg(90, 40, orientation=6), None),
    "jpeg rotated 270": (rotated_jpeg(30, 100, orientation=8), {"min_pixels": 40_000}),
    "huge flat": (flat_png(5000, 3000, "L"), {"max_pixels": 60_000}),
    "min = max": (
        encoded(random_image(200, 100, seed=12)),
        {"min_pixels": 6272, "max_pixels": 6272},
    ),
    "scaled up": (encoded(random_image(30, 20, seed=13)), {"min_pixels": 200_000}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_remote_plan_has_the_local_grid_tokens_and_positions(
    name: str, local: InputProcessor, remote: InputProcessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, kwargs = CASES[name]
    want = local.process_chat(chat(data_url(data)), mm_processor_kwargs=kwargs)
    cfg = remote.request_config(kwargs).image
    with monkeypatch.context() as m:
        m.setattr(image_decode, "decode_first_frame", _refuse_decode)
        got = remote.process_chat(chat(data_url(data)), mm_processor_kwargs=kwargs)
    _same_plan(got, want)
    item = got.mm_features[0].data
    assert isinstance(item, RemoteItem)
    assert (item.source, item.payload, item.url, item.rgb_size) == ("bytes", data, None, None)
    assert (item.min_pixels, item.max_pixels) == (cfg.min_pixels, cfg.max_pixels)
    assert item.grid_thw == got.mm_features[0].grid_thw
    assert item.content_digest == blake3.blake3(data).hexdigest()


def test_offline_sources_bytes_file_urls_and_pictures(
    remote: InputProcessor, media_root: Path, no_decoding: None
) -> None:
    png = encoded(random_image(80, 60, seed=20))
    (media_root / "dog.png").write_bytes(png)
    picture = random_image(50, 70, seed=21).convert("P")  # to_rgb'd as the local path does
    sources = [png, data_url(png), f"file://{media_root}/dog.png", picture]
    prompt = {"prompt": ONE_IMAGE * 4, "multi_modal_data": {"image": sources}}
    got = remote.process_generate_input(prompt)
    items = [f.data for f in got.mm_features]
    assert [i.source for i in items] == ["bytes", "bytes", "bytes", "rgb"]
    assert items[0].payload == items[1].payload == items[2].payload == png
    assert len({f.identifier for f in got.mm_features[:3]}) == 1  # the same file, one item
    rgb = items[3]
    assert rgb.rgb_size == (50, 70) and rgb.payload == to_rgb(picture).tobytes()
    assert rgb.content_digest == blake3.blake3(rgb.payload).hexdigest()
    parts = [{"type": "image", "image": picture}, {"type": "text", "text": "hi"}]
    by_chat = remote.process_chat([{"role": "user", "content": parts}])
    assert by_chat.mm_features[0].identifier == got.mm_features[3].identifier


def test_offline_plans_match_the_local_path(local: InputProcessor, remote: InputProcessor) -> None:
    png = encoded(random_image(80, 60, seed=20))
    picture = random_image(50, 70, seed=21).convert("P")
    prompt = {"prompt": ONE_IMAGE * 2, "multi_modal_data": {"image": [png, picture]}}
    _same_plan(remote.process_generate_input(prompt), local.process_generate_input(prompt))


def test_videos_keep_the_local_path(remote: InputProcessor) -> None:
    prompt = {
        "prompt": "<|vision_start|><|video_pad|><|vision_end|>what happens?",
        "multi_modal_data": {"video": video_frames(4, 56, 56)},
    }
    (video,) = remote.process_generate_input(prompt).mm_features
    assert video.modality == "video" and isinstance(video.data, ProcessedImage)


# ---------------------------------------------------------------------------- identity


def test_identity_is_stable_across_processors_and_never_a_local_one(
    qwen2_vl_dir: Path, media_root: Path, local: InputProcessor, remote: InputProcessor
) -> None:
    a, b = encoded(random_image(90, 60, seed=30)), encoded(random_image(90, 60, seed=31))
    other = _processor(qwen2_vl_dir, media_root, _planner(qwen2_vl_dir))  # its own empty cache

    def ident(proc: InputProcessor, data: bytes, kwargs: dict | None = None) -> str:
        return (
            proc.process_chat(chat(data_url(data)), mm_processor_kwargs=kwargs)
            .mm_features[0]
            .identifier
        )

    assert ident(remote, a) == ident(other, a)
    assert ident(remote, a) != ident(remote, b)
    assert ident(remote, a) != ident(local, a)
    # A cap that changes the grid changes the identity; one that changes nothing does not
    # (as for local items: identity covers what processing does, not the raw kwargs).
    assert ident(remote, a, {"max_pixels": 56 * 56}) != ident(remote, a)
    assert ident(remote, a, {"max_pixels": 4000 * 4000}) == ident(remote, a)
    picture = random_image(40, 40, seed=32)
    rgb_id = remote.process_generate_input(
        {"prompt": ONE_IMAGE, "multi_modal_data": {"image": picture}}
    ).mm_features[0]
    local_id = local.process_generate_input(
        {"prompt": ONE_IMAGE, "multi_modal_data": {"image": picture}}
    ).mm_features[0]
    assert rgb_id.identifier != local_id.identifier and rgb_id.grid_thw == local_id.grid_thw
    # Under one caller uuid the content keys are equal: only the hash domain tells them apart.
    claimed = {"prompt": ONE_IMAGE, "multi_modal_data": {"image": picture}}
    claimed["multi_modal_uuids"] = {"image": "same-uuid"}
    assert (
        remote.process_generate_input(claimed).mm_features[0].identifier
        != local.process_generate_input(claimed).mm_features[0].identifier
    )
    other.media_loader.close()


# ---------------------------------------------------------------------- hostile headers

HOSTILE = {
    "pixel bomb": flat_png(9000, 9000, "1"),
    "garbage": b"this is not an image, whatever the data: URL says" * 3,
    "truncated header": encoded(random_image(64, 64, seed=40))[:24],
    "empty": b"",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_images_get_the_local_400_without_decoding(
    name: str, local: InputProcessor, remote: InputProcessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = data_url(HOSTILE[name])
    with pytest.raises(InvalidRequestError) as want:
        local.process_chat(chat(url))
    monkeypatch.setattr(image_decode, "decode_first_frame", _refuse_decode)
    with pytest.raises(InvalidRequestError) as got:
        remote.process_chat(chat(url))
    assert type(got.value) is type(want.value)
    assert isinstance(got.value, ImageDecodeError) and got.value.status_code == 400
    assert (got.value.message, got.value.param) == (want.value.message, want.value.param)


def test_the_request_decode_budget_counts_remote_images_too(
    qwen2_vl_dir: Path, media_root: Path
) -> None:
    png = encoded(random_image(300, 300, seed=41))
    small = {"max_decode_bytes_per_request": 3 << 20, "max_inflight_decode_bytes": 3 << 20}
    errors = []
    for planner in (None, _planner(qwen2_vl_dir)):
        proc = _processor(qwen2_vl_dir, media_root, planner, **small)
        proc.process_chat(chat(data_url(png)))  # one fits
        with pytest.raises(ImageTooLargeError) as info:
            proc.process_chat(chat(*[data_url(png)] * 2))
        errors.append(info.value.message)
        proc.media_loader.close()
    assert errors[0] == errors[1] and "--max-decode-bytes-per-request" in errors[0]


def test_headers_are_read_in_the_isolated_decode_workers(local: InputProcessor) -> None:
    loader = MediaLoader(MediaConfig(decode_workers=1, max_image_pixels=4096 * 4096))
    try:
        jpeg = rotated_jpeg(90, 40, orientation=6)
        header = loader.read_image_header(jpeg)
        decoded = local.media_loader.load_image(jpeg)
        assert (header.width, header.height) == decoded.size == (90, 40)
        with pytest.raises(ImageTooLargeError) as bomb:
            loader.read_image_header(HOSTILE["pixel bomb"])
        assert "over the 16777216-pixel limit" in bomb.value.message
        with pytest.raises(ImageDecodeError, match="not a supported image"):
            loader.read_image_header(HOSTILE["garbage"])
        # An image in its own mode and format, and the worker served every request alive.
        png = loader.read_image_header(encoded(random_image(8, 8).convert("P")))
        assert (png.format, png.mode, png.width, png.height) == ("PNG", "P", 8, 8)
        assert loader._pool is not None and loader._pool.num_started == 1  # errors kill none
    finally:
        loader.close()


# ----------------------------------------------------------------------------- URLs


def test_a_planned_url_is_sent_as_a_reference(
    remote: InputProcessor, fresh_planner: FakePlanner, no_decoding: None
) -> None:
    kwargs = {"max_pixels": 5000}
    got = remote.process_chat(chat(CAT_URL), mm_processor_kwargs=kwargs)
    cfg = remote.request_config(kwargs).image
    assert fresh_planner.calls == [(CAT_URL, cfg.min_pixels, cfg.max_pixels)]
    item = got.mm_features[0].data
    assert isinstance(item, RemoteItem)
    assert (item.source, item.payload, item.url) == ("url", None, CAT_URL)
    assert item.content_digest == blake3.blake3(PAGES[CAT_URL]).hexdigest()
    inline = remote.process_chat(chat(data_url(PAGES[CAT_URL])), mm_processor_kwargs=kwargs)
    assert got.mm_features[0].identifier == inline.mm_features[0].identifier  # the same bytes
    assert got.prompt_token_ids == inline.prompt_token_ids
    asynchronous = asyncio.run(remote.aprocess_chat(chat(CAT_URL), mm_processor_kwargs=kwargs))
    assert asynchronous.mm_features[0].identifier == got.mm_features[0].identifier

    async def sync_call_inside_a_running_loop() -> ProcessedPrompt:
        return remote.process_generate_input(
            {
                "prompt": ONE_IMAGE,
                "multi_modal_data": {"image": CAT_URL},
                "mm_processor_kwargs": kwargs,
            }
        )

    offline = asyncio.run(sync_call_inside_a_running_loop())
    assert offline.mm_features[0].identifier == got.mm_features[0].identifier


def test_a_url_the_pool_refuses_fails_with_its_400(
    remote: InputProcessor, fresh_planner: FakePlanner
) -> None:
    fresh_planner.mode = "refuse"
    with pytest.raises(MediaFetchRefusedError, match="host is not allowed") as info:
        asyncio.run(remote.aprocess_chat(chat(CAT_URL)))
    assert info.value.status_code == 400 and info.value.param == "image_url"


@pytest.mark.parametrize("mode", ["unavailable", "wrong_grid"])
def test_an_unavailable_pool_falls_back_to_the_local_path(
    mode: str, remote: InputProcessor, local: InputProcessor, fresh_planner: FakePlanner
) -> None:
    fresh_planner.mode = mode
    got = asyncio.run(remote.aprocess_chat(chat(CAT_URL)))
    offline = remote.process_chat(chat(CAT_URL))
    want = local.process_chat(chat(data_url(PAGES[CAT_URL])))
    for prompt in (got, offline):
        _same_plan(prompt, want)
        assert prompt.mm_features[0].identifier == want.mm_features[0].identifier  # pixels


@pytest.mark.parametrize("mode", ["unavailable", "wrong_grid"])
def test_an_unavailable_pool_without_fallback_is_a_503(
    mode: str, qwen2_vl_dir: Path, media_root: Path
) -> None:
    planner = _planner(qwen2_vl_dir)
    planner.mode = mode
    proc = _processor(qwen2_vl_dir, media_root, None)
    strict = InputProcessor(
        proc.tokenizer,
        proc.image_config,
        proc.token_ids,
        max_model_len=8192,
        media_loader=proc.media_loader,
        remote_images=RemoteImagePlanning(planner, fallback_local=False),
    )
    for run in (
        lambda: asyncio.run(strict.aprocess_chat(chat(CAT_URL))),
        lambda: strict.process_chat(chat(CAT_URL)),
    ):
        with pytest.raises(EncoderUnavailableError, match="--encoder-fallback fail") as info:
            run()
        assert info.value.status_code == 503
    proc.media_loader.close()


# ---------------------------------------------------------------- uuids, cache, limits


def test_uuid_references_to_remote_images_resolve_to_the_same_identity(
    remote: InputProcessor, fresh_planner: FakePlanner
) -> None:
    png = encoded(random_image(300, 200, seed=50))
    sent = remote.process_generate_input(
        {
            "prompt": ONE_IMAGE,
            "multi_modal_data": {"image": png},
            "multi_modal_uuids": {"image": "cat"},
        },
        namespace="key-a",
    )
    again = remote.process(ONE_IMAGE, [None], multi_modal_uuids=["cat"], namespace="key-a")
    assert again.mm_features[0].identifier == sent.mm_features[0].identifier
    assert again.mm_features[0].data is sent.mm_features[0].data
    assert isinstance(again.mm_features[0].data, RemoteItem)
    big_cap = {"max_pixels": 4000 * 4000}
    same = remote.process(
        ONE_IMAGE, [None], multi_modal_uuids=["cat"], namespace="key-a", mm_processor_kwargs=big_cap
    )
    assert same.mm_features[0].identifier == sent.mm_features[0].identifier
    with pytest.raises(UnknownMediaUUIDError, match="send the image again"):
        remote.process(ONE_IMAGE, [None], multi_modal_uuids=["cat"], namespace="key-b")
    with pytest.raises(UnknownMediaUUIDError, match="send the image again"):
        remote.process(
            ONE_IMAGE,
            [None],
            multi_modal_uuids=["cat"],
            namespace="key-a",
            mm_processor_kwargs={"max_pixels": 100 * 100},
        )
    # Over HTTP: a URL planned by the pool, then referenced by its uuid alone.
    first = asyncio.run(remote.aprocess_chat(chat(CAT_URL, uuids=("u-7",)), namespace="api-key-1"))
    by_uuid = asyncio.run(
        remote.aprocess_chat(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"uuid": "u-7"}}]}],
            namespace="api-key-1",
        )
    )
    assert by_uuid.mm_features[0].identifier == first.mm_features[0].identifier
    assert len(fresh_planner.calls) == 1
    remote.cache.check_integrity()


def test_item_limits_come_before_any_plan(qwen2_vl_dir: Path, media_root: Path) -> None:
    planner = _planner(qwen2_vl_dir)
    proc = _processor(qwen2_vl_dir, media_root, planner)
    limited = InputProcessor(
        proc.tokenizer,
        proc.image_config,
        proc.token_ids,
        max_model_len=8192,
        limit_mm_per_prompt={"image": 1},
        media_loader=proc.media_loader,
        remote_images=RemoteImagePlanning(planner),
    )
    with pytest.raises(TooManyItemsError):
        asyncio.run(limited.aprocess_chat(chat(CAT_URL, CAT_URL)))
    assert planner.calls == []
    proc.media_loader.close()
