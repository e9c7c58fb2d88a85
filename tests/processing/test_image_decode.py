"""Decoding reads the header first: pixel cap and memory estimate before any pixel buffer exists."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest
from PIL import Image

from mmserve.config.media import MediaConfig
from mmserve.errors import ImageTooLargeError
from mmserve.processing.image_decode import (
    DEFAULT_MAX_IMAGE_PIXELS,
    MAX_EXIF_BYTES,
    ImageHeader,
    decode_image_bytes,
    read_header,
    webp_canvas_size,
)
from mmserve.processing.media import MediaLoader
from tests.support.factory import flat_png, random_image


def _encode(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def test_default_pixel_cap_is_what_the_largest_accepted_image_needs() -> None:
    assert DEFAULT_MAX_IMAGE_PIXELS == 4096 * 4096

    def cap(processor_max_pixels: int) -> int | None:
        loaded = MediaConfig().for_loader(
            processor_max_pixels=processor_max_pixels, decode_workers=0
        )
        return loaded.max_image_pixels

    assert cap(12544) == 4096 * 4096  # the toy model's max_pixels
    assert cap(5000 * 5000) == 5000 * 5000  # a processor keeping more
    assert MediaConfig().image_pixel_cap == 4096 * 4096  # not Pillow's 89 MP any more


def test_9000px_one_bit_png_is_refused_from_its_header_without_allocating() -> None:
    bomb = flat_png(9000, 9000, "1")  # ~21 KB on the wire, 81 MP decoded
    assert len(bomb) < 32 * 1024
    tracemalloc.start()
    try:
        start = time.monotonic()
        with pytest.raises(ImageTooLargeError) as info:
            MediaLoader().load_image(bomb)
        elapsed = time.monotonic() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    err = info.value
    assert err.status_code == 400 and err.param == "image_url" and err.code == "image_too_large"
    assert "9000x9000 = 81000000 pixels" in err.message
    assert "16777216-pixel limit (--max-image-pixels)" in err.message
    # Decoding would take 81 MB (mode 1) + 324 MB (RGB) and ~1.4 s here; Pillow's buffers do
    # not show in tracemalloc (Python objects do), so the wall time is the second witness.
    assert peak < 2 * 1024 * 1024, peak
    assert elapsed < 0.25


def test_under_the_cap_a_one_bit_image_decodes_to_rgb() -> None:
    img = MediaLoader().load_image(flat_png(64, 48, "1"))
    assert img.mode == "RGB" and img.size == (64, 48)


MIB = 1 << 20  # decoder state, counted once per image


@pytest.mark.parametrize(
    ("mode", "transparency", "per_pixel"),
    [
        # max(own mode + conversion to RGB, RGB + packed copy (3) with its join chunks (3))
        ("1", False, max(1 + 4, 4 + 6)),
        ("P", False, max(1 + 4, 4 + 6)),
        ("L", False, max(1 + 4, 4 + 6)),
        ("P", True, max(1 + 16, 4 + 6)),  # transparency: RGBA, white, composite, then RGB
        ("RGB", False, max(4, 4 + 6)),  # Pillow keeps RGB in 32-bit pixels
        ("RGBA", False, max(4 + 16, 4 + 6)),
        ("I;16", False, max(2 + 4, 4 + 6)),
    ],
)
def test_decode_estimate_is_mode_aware(mode: str, transparency: bool, per_pixel: int) -> None:
    header = ImageHeader("PNG", 1000, 500, mode, has_transparency=transparency)
    assert header.decode_bytes == 500_000 * per_pixel + MIB


def test_estimate_comes_from_real_headers_palette_included() -> None:
    palette = Image.new("P", (300, 200))
    palette.putpalette([0, 0, 0, 255, 0, 0] * 128)
    _, header = read_header(_encode(palette), 10**8)
    assert (header.mode, header.num_pixels) == ("P", 60_000)
    assert header.decode_bytes == 60_000 * 10 + MIB
    _, with_alpha = read_header(_encode(palette, transparency=0), 10**8)
    assert with_alpha.has_transparency and with_alpha.decode_bytes == 60_000 * 17 + MIB
    _, webp = read_header(_encode(random_image(30, 20), "WEBP"), 10**8)
    assert webp.decode_bytes == 600 * (10 + 8) + MIB  # libwebp's two canvases on top


_PEAK_SCRIPT = textwrap.dedent(
    """
    import sys
    from mmserve.processing.image_decode import decode_image_bytes, read_header
    from tests.support.factory import flat_png

    def high_water_bytes():  # VmHWM is per address space: unlike ru_maxrss, exec resets it
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    data = flat_png(4096, 4096, sys.argv[1])
    _, header = read_header(data, 1 << 40)
    before = high_water_bytes()
    img = decode_image_bytes(data, 1 << 40)
    pixels = img.tobytes()  # what a worker sends and what identity hashes
    print(header.decode_bytes, high_water_bytes() - before)
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("mode", ["1", "RGB", "RGBA"])
def test_estimate_bounds_the_real_peak_memory_of_a_decode(mode: str) -> None:
    """Oracle: the kernel's peak RSS of a fresh process decoding a 4096x4096 image."""
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    estimate, peak = (int(v) for v in out.stdout.split())
    assert peak <= estimate, (mode, peak, estimate)
    assert peak >= estimate * 0.7, (mode, peak, estimate)  # and not a wild overestimate


def test_only_the_first_frame_of_an_animation_is_decoded() -> None:
    frames = []
    for i in range(3):
        frame = Image.new("P", (64, 64), i + 1)
        frame.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * 756)
        frames.append(frame)
    gif = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert Image.open(io.BytesIO(gif)).n_frames == 3
    # Cut the file inside the second frame: a path that touched it would fail.
    second = gif.index(b"\x2c", gif.index(b"\x2c") + 10)
    img = decode_image_bytes(gif[: second + 12] + b"\xff" * 8)
    assert img.getpixel((10, 10)) == (255, 0, 0)
    apng = _encode(
        random_image(32, 32, seed=1), "PNG", save_all=True, append_images=[random_image(32, 32)]
    )
    assert decode_image_bytes(apng).tobytes() == random_image(32, 32, seed=1).tobytes()


def test_webp_size_is_read_before_libwebp_allocates_its_canvas() -> None:
    for kwargs in ({"lossless": True}, {"quality": 80}, {"exif": b"Exif\0\0" + b"\0" * 8}):
        data = _encode(random_image(37, 21), "WEBP", **kwargs)
        assert webp_canvas_size(data) == (37, 21), kwargs
    # A VP8X header claiming 16000x16000 is refused with its own size, before Image.open.
    forged = bytearray(_encode(random_image(8, 8), "WEBP", exif=b"Exif\0\0" + b"\0" * 8))
    assert forged[12:16] == b"VP8X"
    forged[24:27] = (16000 - 1).to_bytes(3, "little")
    forged[27:30] = (16000 - 1).to_bytes(3, "little")
    with pytest.raises(ImageTooLargeError, match="16000x16000 = 256000000 pixels"):
        decode_image_bytes(bytes(forged))
    assert webp_canvas_size(b"RIFF\0\0\0\0WEBPVP8 " + b"\0" * 20) is None  # no start code


def test_only_a_small_exif_block_rides_along_with_the_decoded_image() -> None:
    image = random_image(16, 16)
    exif = Image.Exif()
    exif[0x010E] = "a description"
    small = decode_image_bytes(_encode(image, "PNG", exif=exif, icc_profile=b"\0" * 5000))
    assert set(small.info) == {"exif"}  # ICC profile and text chunks are not kept
    assert small.getexif()[0x010E] == "a description"
    exif[0x010E] = "x" * (MAX_EXIF_BYTES + 1)
    big = decode_image_bytes(_encode(image, "PNG", exif=exif))
    assert big.info == {} and big.tobytes() == image.tobytes()


def test_admit_sees_the_header_before_decoding_and_can_refuse() -> None:
    seen: list[ImageHeader] = []

    class Refused(Exception):
        pass

    def refuse(header: ImageHeader) -> None:
        seen.append(header)
        raise Refused

    with pytest.raises(Refused):
        decode_image_bytes(flat_png(100, 80, "P"), admit=refuse)
    assert [(h.mode, h.width, h.height) for h in seen] == [("P", 100, 80)]

    released: list[int] = []
    img = decode_image_bytes(flat_png(10, 10, "L"), admit=lambda h: lambda: released.append(1))
    assert released == []  # held while the decoded image lives
    del img
    assert released == [1]
    corrupt = flat_png(50, 50, "RGB")[:-40]
    with pytest.raises(Exception, match="truncated or corrupt"):
        decode_image_bytes(corrupt, admit=lambda h: lambda: released.append(2))
    assert released == [1, 2]  # a failed decode gives its reservation back at once
