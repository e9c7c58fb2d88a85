"""Remote mode of the input processor: images planned for the encoder pool, never decoded here,
with the local processor as the oracle for grids, placeholder counts, positions and errors."""

from __future__ import annotations

from pathlib import Path

import blake3
import pytest

from mmserve.errors import ImageDecodeError, ImageTooLargeError, InvalidRequestError
from mmserve.multimodal import EncoderInput, RemoteItem
from mmserve.processing import image_decode
from mmserve.processing.decode_workers import DecodeWorkerPool
from mmserve.processing.image_processor import get_grid_thw, to_rgb
from mmserve.processing.input_processor import InputProcessor
from tests.processing.remote_helpers import (
    ONE_IMAGE,
    chat,
    data_url,
    encoded,
    make_planner,
    make_processor,
    refuse_decode,
    rotated_jpeg,
    same_plan,
)
from tests.support.factory import flat_png, random_image, video_frames

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
        m.setattr(image_decode, "decode_first_frame", refuse_decode)
        got = remote.process_chat(chat(data_url(data)), mm_processor_kwargs=kwargs)
    same_plan(got, want)
    item = got.mm_data[got.mm_features[0].identifier]
    assert isinstance(item, RemoteItem)
    assert (item.source, bytes(item.payload_bytes), item.url, item.rgb_size) == (
        "bytes",
        data,
        None,
        None,
    )
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
    items = [got.mm_data[f.identifier] for f in got.mm_features]
    assert [i.source for i in items] == ["bytes", "bytes", "bytes", "rgb"]
    assert [bytes(i.payload_bytes) for i in items[:3]] == [png] * 3
    assert len({f.identifier for f in got.mm_features[:3]}) == 1  # the same file, one item
    rgb = items[3]
    assert rgb.rgb_size == (50, 70) and bytes(rgb.payload_bytes) == to_rgb(picture).tobytes()
    assert rgb.content_digest == blake3.blake3(bytes(rgb.payload_bytes)).hexdigest()
    parts = [{"type": "image", "image": picture}, {"type": "text", "text": "hi"}]
    by_chat = remote.process_chat([{"role": "user", "content": parts}])
    assert by_chat.mm_features[0].identifier == got.mm_features[3].identifier


def test_offline_plans_match_the_local_path(local: InputProcessor, remote: InputProcessor) -> None:
    png = encoded(random_image(80, 60, seed=20))
    picture = random_image(50, 70, seed=21).convert("P")
    prompt = {"prompt": ONE_IMAGE * 2, "multi_modal_data": {"image": [png, picture]}}
    same_plan(remote.process_generate_input(prompt), local.process_generate_input(prompt))


def test_videos_keep_the_local_path(remote: InputProcessor) -> None:
    prompt = {
        "prompt": "<|vision_start|><|video_pad|><|vision_end|>what happens?",
        "multi_modal_data": {"video": video_frames(4, 56, 56)},
    }
    processed = remote.process_generate_input(prompt)
    (video,) = processed.mm_features
    assert video.modality == "video" and isinstance(
        processed.mm_data[video.identifier], EncoderInput
    )


# ---------------------------------------------------------------------------- identity


def test_identity_is_stable_across_processors_and_never_a_local_one(
    qwen2_vl_dir: Path, media_root: Path, local: InputProcessor, remote: InputProcessor
) -> None:
    a, b = encoded(random_image(90, 60, seed=30)), encoded(random_image(90, 60, seed=31))
    other = make_processor(
        qwen2_vl_dir, media_root, make_planner(qwen2_vl_dir)
    )  # its own empty cache

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
    monkeypatch.setattr(image_decode, "decode_first_frame", refuse_decode)
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
    for planner in (None, make_planner(qwen2_vl_dir)):
        proc = make_processor(qwen2_vl_dir, media_root, planner, **small)
        proc.process_chat(chat(data_url(png)))  # one fits
        with pytest.raises(ImageTooLargeError) as info:
            proc.process_chat(chat(*[data_url(png)] * 2))
        errors.append(info.value.message)
        proc.media_loader.close()
    assert errors[0] == errors[1] and "--max-decode-bytes-per-request" in errors[0]


def test_headers_are_read_in_the_isolated_decode_workers(local: InputProcessor) -> None:
    pool = DecodeWorkerPool(1, timeout_s=30.0, max_rss_bytes=0)
    try:
        jpeg = rotated_jpeg(90, 40, orientation=6)
        header = pool.read_header(jpeg, 4096 * 4096)
        assert (header.width, header.height) == local.media_loader.load_image(jpeg).size
        with pytest.raises(ImageTooLargeError) as bomb:
            pool.read_header(HOSTILE["pixel bomb"], 4096 * 4096)
        assert "over the 16777216-pixel limit" in bomb.value.message
        with pytest.raises(ImageDecodeError, match="not a supported image"):
            pool.read_header(HOSTILE["garbage"], 4096 * 4096)
        png = pool.read_header(encoded(random_image(8, 8).convert("P")), 4096 * 4096)
        assert (png.format, png.mode, png.width, png.height) == ("PNG", "P", 8, 8)
        assert pool.num_started == 1  # refusing a header kills no worker
    finally:
        pool.close()


def test_a_server_with_decode_workers_plans_from_their_headers(
    qwen2_vl_dir: Path, media_root: Path, no_decoding: None
) -> None:
    proc = make_processor(qwen2_vl_dir, media_root, make_planner(qwen2_vl_dir), decode_workers=1)
    try:
        url = data_url(rotated_jpeg(30, 100, orientation=8))
        got = proc.process_chat(chat(url))
        assert got.mm_features[0].grid_thw == get_grid_thw(30, 100, proc.image_config)
        with pytest.raises(ImageTooLargeError):
            proc.process_chat(chat(data_url(HOSTILE["pixel bomb"])))
    finally:
        proc.media_loader.close()
