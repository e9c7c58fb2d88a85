"""Reading a media source (PIL image, bytes, data:, http(s):// or file:// URL) to its bytes."""

from __future__ import annotations

import base64
import binascii
from dataclasses import replace

from PIL import Image

from mmserve.errors import MediaError, MediaFetchRefusedError
from mmserve.processing.file_urls import read_file_url
from mmserve.processing.http_fetch import FetchPolicy, fetch_url
from mmserve.processing.image_processor import to_rgb

MediaSource = Image.Image | bytes | str


def read_media_source(
    source: MediaSource,
    what: str,
    *,
    max_bytes: int,
    fetch_policy: FetchPolicy,
    allowed_local_media_path: str | None,
) -> Image.Image | bytes:
    """An RGB image for a PIL source; the encoded bytes for every other kind. `what`:
    "image" or "video" (its data: media type, the field errors name); `max_bytes` its cap."""
    if isinstance(source, Image.Image) and what == "image":
        return to_rgb(source)
    if isinstance(source, bytes | bytearray | memoryview):
        return bytes(source)
    if not isinstance(source, str):
        raise MediaError(
            f"unsupported {what} source of type {type(source).__name__}; pass "
            f"{'a PIL image, ' if what == 'image' else 'frames, '}bytes, or a data:, "
            "http(s):// or file:// URL",
            param=f"{what}_url",
        )
    scheme = url_scheme(source)
    if scheme == "data":
        return read_data_url(source, what, max_bytes)
    if scheme in ("http", "https"):
        return fetch_url(source, replace(fetch_policy, max_bytes=max_bytes))
    if scheme == "file":
        return read_file_url(source, allowed_local_media_path, max_bytes, what)
    raise MediaFetchRefusedError(
        f"{what} URL must be a data:, http(s):// or (when enabled) file:// URL",
        param=f"{what}_url",
    )


def read_data_url(url: str, what: str, max_bytes: int) -> bytes:
    """The payload of a base64 `data:` URL whose media type (if any) is of the `what` kind."""
    header, sep, payload = url.partition(",")
    example = "image/png" if what == "image" else "video/mp4"
    if not sep or not header.lower().endswith(";base64"):
        raise MediaError(
            f"data: URL must look like data:{example};base64,<base64 data>",
            param=f"{what}_url",
        )
    media_type = header[5:-7].strip().lower()
    if media_type and not media_type.startswith(f"{what}/"):
        raise MediaError(
            f"data: URL media type {media_type!r} is not {'an' if what == 'image' else 'a'} "
            f"{what} type",
            param=f"{what}_url",
        )
    if len(payload) * 3 // 4 > max_bytes:
        raise MediaFetchRefusedError(
            f"{what} is larger than the {max_bytes}-byte limit", param=f"{what}_url"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("data: URL payload is not valid base64") from None


def url_scheme(url: str) -> str:
    return url.split(":", 1)[0].lower() if ":" in url else ""
