"""file:// media under --allowed-local-media-path: decided on the path, then read capped."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from urllib.parse import unquote_to_bytes, urlsplit

from mmserve.errors import MediaError, MediaFetchRefusedError


def read_file_url(url: str, root: str | None, max_bytes: int, what: str = "image") -> bytes:
    """Read a file:// URL under --allowed-local-media-path.

    Decided on the lexical path first (no disk access), so the answer for a path outside
    the root is the same whether or not it exists; symlinks are resolved only then, and the
    resolved path is checked again.
    """
    if root is None:
        raise MediaFetchRefusedError(
            "file:// URLs are disabled; start the server with --allowed-local-media-path",
            param=f"{what}_url",
        )
    path = _file_url_path(url, f"{what}_url")
    roots = (os.path.normpath(root), str(Path(root).resolve()))
    if not any(PurePosixPath(path).is_relative_to(r) for r in roots):
        raise _outside_root(f"{what}_url")
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError, ValueError):
        raise MediaError(
            "file:// URL names a file that could not be read", param=f"{what}_url"
        ) from None
    if not resolved.is_relative_to(roots[1]):
        raise _outside_root(f"{what}_url")  # a symlink under the root that points out of it
    try:
        if not resolved.exists():
            raise MediaError(
                "file:// URL names no file under --allowed-local-media-path",
                param=f"{what}_url",
            )
        if not resolved.is_file():
            raise MediaError("file:// URL does not name a regular file", param=f"{what}_url")
        with resolved.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError:
        raise MediaError(
            "file:// URL names a file that could not be read", param=f"{what}_url"
        ) from None
    if len(data) > max_bytes:
        raise MediaFetchRefusedError(
            f"{what} is larger than the {max_bytes}-byte limit",
            param=f"{what}_url",
        )
    return data


def _file_url_path(url: str, param: str = "image_url") -> str:
    """The absolute, lexically normalised path a file:// URL names; 400 if it names none."""
    if "\\" in url or not url.isascii() or not url.isprintable():
        raise MediaFetchRefusedError(
            "file:// URL contains a backslash, a control character or a non-ASCII character; "
            "percent-encode the path",
            param=param,
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise MediaFetchRefusedError("file:// URL must be file:///absolute/path", param=param)
    try:
        path = unquote_to_bytes(parts.path).decode("utf-8")
    except UnicodeDecodeError:
        raise MediaFetchRefusedError(
            "file:// URL path is not valid UTF-8 once percent-decoded", param=param
        ) from None
    if not path.startswith("/") or not path.isprintable():
        raise MediaFetchRefusedError(
            "file:// URL must name an absolute path without NUL or control characters",
            param=param,
        )
    return os.path.normpath(path)


def _outside_root(param: str = "image_url") -> MediaFetchRefusedError:
    return MediaFetchRefusedError("file:// URL is outside --allowed-local-media-path", param=param)
