"""Image decoding that reads the header first and refuses oversized images before any pixel exists.

The pixel cap and the decode-memory estimate are checked from the header alone (Image.open
parses headers, it does not decode); only then, and only after `admit` agreed, are the pixels
of the first frame decoded and converted to RGB. Worker processes: `decode_workers.py`.
"""

from __future__ import annotations

import io
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from mmserve.config.media import DEFAULT_MAX_IMAGE_PIXELS
from mmserve.errors import ImageDecodeError, ImageTooLargeError
from mmserve.processing.decode_budget import Release, hold_until_collected
from mmserve.processing.image_processor import to_rgb

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# The default pixel cap is the larger of this and the image processor's max_pixels: smart_resize
# brings every image down to max_pixels anyway, and 4096x4096 covers 4K photos for any model.
# EXIF rides along for its ImageUniqueID only; a JPEG's APP1 segment holds at most 64 KiB, and a
# larger block (PNG eXIf can be any size) is dropped rather than kept with the image.
MAX_EXIF_BYTES = 64 * 1024

# Bytes per pixel of Pillow's in-memory storage by mode: 1-bit, grey and palette images take one
# byte, 16-bit grey two, everything else is stored as 32-bit pixels (RGB included).
_STORAGE_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16L": 2, "I;16B": 2, "I;16N": 2}
_RGB_BYTES = 4  # the RGB image Pillow holds
# tobytes(), which a worker sends and identity hashes: the packed copy (3 bytes) plus, while
# Pillow joins it, the list of chunks it is joined from (3 more).
_PACKED_RGB_BYTES = 6
# RGBA copy, white background, composite, then RGB: to_rgb's buffers for a transparent image.
_COMPOSITE_BYTES = 4 * _RGB_BYTES
_WEBP_CANVAS_BYTES = 8  # libwebp's decoder keeps two RGBA canvases
_DECODER_STATE_BYTES = 1 << 20  # row buffers and inflate window; measured ~0.3 MB for 4096 wide


@dataclass(frozen=True, slots=True)
class ImageHeader:
    """What the header says, before decoding: enough to refuse or to budget the decode."""

    format: str
    width: int
    height: int
    mode: str
    has_transparency: bool

    @property
    def num_pixels(self) -> int:
        return self.width * self.height

    @property
    def decode_bytes(self) -> int:
        """Estimated peak memory of decoding this image to RGB (see `estimate_decode_bytes`)."""
        return estimate_decode_bytes(self.format, self.mode, self.has_transparency, self.num_pixels)


def estimate_decode_bytes(fmt: str, mode: str, has_transparency: bool, num_pixels: int) -> int:
    """Peak bytes of a decode, from the header: the larger of its two phases.

      phase 1: the image in its own mode + the buffers that convert it to RGB
      phase 2: the RGB image + its packed copy (tobytes, sent by a worker, hashed for identity)

    A 1-bit or palette image is small on the wire but expands: 1 byte per pixel decoded, 4 as
    RGB. Unknown modes are taken as 32-bit. tests/processing/test_image_decode.py checks this
    against the kernel's high-water mark of real decodes.
    """
    native = _STORAGE_BYTES.get(mode, 4)
    if mode == "RGB" and not has_transparency:
        conversion = 0
    elif has_transparency or "A" in mode.upper():  # LA, La, PA, RGBA, RGBa
        conversion = _COMPOSITE_BYTES
    else:
        conversion = _RGB_BYTES
    per_pixel = max(native + conversion, _RGB_BYTES + _PACKED_RGB_BYTES)
    canvas = _WEBP_CANVAS_BYTES if fmt == "WEBP" else 0
    return num_pixels * (per_pixel + canvas) + _DECODER_STATE_BYTES


Admit = Callable[[ImageHeader], Release | None]


def read_header(data: bytes, max_pixels: int) -> tuple[Image.Image, ImageHeader]:
    """Open (not decode) the image and check its size against `max_pixels`."""
    if not data:
        raise ImageDecodeError("the image is empty (0 bytes)")
    webp_size = webp_canvas_size(data)
    if webp_size is not None:
        # libwebp allocates its canvases while opening, so the cap is checked before that.
        _check_pixels(*webp_size, max_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=list(ALLOWED_FORMATS))
    except Image.DecompressionBombError:
        raise _too_many_pixels_error(None, None, max_pixels) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, struct.error):
        raise ImageDecodeError(
            f"the data is not a supported image; send one of {', '.join(ALLOWED_FORMATS)}"
        ) from None
    width, height = img.size
    if width <= 0 or height <= 0:
        raise ImageDecodeError("the image has an empty side")
    _check_pixels(width, height, max_pixels)
    header = ImageHeader(
        format=img.format or "",
        width=width,
        height=height,
        mode=img.mode,
        has_transparency=img.info.get("transparency") is not None,
    )
    return img, header


def decode_image_bytes(
    data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, *, admit: Admit | None = None
) -> Image.Image:
    """Decode the first frame of `data` into an RGB image.

    `admit(header)` runs after the header checks and before any pixel is decoded; it may refuse
    (raise) or return a release that is held until the returned image is garbage (or called at
    once if decoding fails). The raw EXIF block (if small) is kept in `info["exif"]` so that
    the EXIF ImageUniqueID survives the RGB conversion; nothing else from `info` is kept.
    """
    img, header = read_header(data, max_pixels)
    release = admit(header) if admit is not None else None
    try:
        rgb = decode_first_frame(img)
    except BaseException:
        if release is not None:
            release()
        raise
    hold_until_collected(rgb, release)
    return rgb


def decode_first_frame(img: Image.Image) -> Image.Image:
    """Decode an opened image's current (first) frame only, as RGB; never seeks other frames."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.load()
            exif = img.info.get("exif")
            rgb = to_rgb(img)
            rgb.load()
    except Exception:  # noqa: BLE001 - any decoder failure is the client's bad data
        raise ImageDecodeError(
            f"the {img.format or 'image'} data is truncated or corrupt and could not be decoded"
        ) from None
    # convert() copies info (ICC profiles, PNG text chunks, XMP): none of it is used downstream.
    small_exif = isinstance(exif, bytes) and 0 < len(exif) <= MAX_EXIF_BYTES
    rgb.info = {"exif": exif} if small_exif else {}
    return rgb


def webp_canvas_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a WebP file's first chunk (VP8X, VP8L or VP8), or None if not WebP.

    Layouts (offsets in the file): RIFF size WEBP at 0..11, chunk tag at 12..15, chunk data at 20.
      VP8X: 24-bit little-endian width-1 at 24, height-1 at 27
      VP8L: signature 0x2f at 20, then 14 bits width-1, 14 bits height-1 (little-endian bits)
      VP8 : start code 9d 01 2a at 23, then 14-bit width at 26, 14-bit height at 28
    """
    if len(data) < 30 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    tag = data[12:16]
    if tag == b"VP8X":
        width = int.from_bytes(data[24:27], "little") + 1
        height = int.from_bytes(data[27:30], "little") + 1
        return width, height
    if tag == b"VP8L" and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if tag == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack_from("<HH", data, 26)
        return width & 0x3FFF, height & 0x3FFF
    return None


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise _too_many_pixels_error(width, height, max_pixels)


def _too_many_pixels_error(width: int | None, height: int | None, max_pixels: int) -> Exception:
    size = f"{width}x{height} = {width * height} pixels" if width and height else "too large"
    return ImageTooLargeError(
        f"the image is {size}, over the {max_pixels}-pixel limit (--max-image-pixels); "
        "downscale it before sending",
        param="image_url",
    )
