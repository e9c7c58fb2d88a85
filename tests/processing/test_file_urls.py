"""file:// media: only under --allowed-local-media-path, and answers that reveal nothing outside."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmserve.config.media import MediaConfig
from mmserve.errors import InvalidRequestError, MediaError, MediaFetchRefusedError
from mmserve.processing.media import MediaLoader
from tests.support.factory import random_image


@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    random_image(10, 10).save(root / "ok.png")
    (root / "escape.png").symlink_to("/etc/passwd")
    (root / "escape_dir").symlink_to("/etc")
    (root / "sub").mkdir()
    return root


def _loader(root: Path) -> MediaLoader:
    return MediaLoader(MediaConfig(allowed_local_media_path=str(root)))


def _error(loader: MediaLoader, url: str) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        loader.load_image(url)
    return info.value


def test_file_urls_need_the_allowed_path(media_root: Path) -> None:
    with pytest.raises(MediaFetchRefusedError, match="allowed-local-media-path"):
        MediaLoader().load_image("file:///etc/passwd")
    loader = _loader(media_root)
    assert loader.load_image(f"file://{media_root}/ok.png").size == (10, 10)
    assert loader.load_image(f"file://localhost{media_root}/sub/../ok.png").size == (10, 10)
    for url in (
        "file:///etc/passwd",
        f"file://{media_root}/../../../etc/passwd",
        f"file://{media_root}/escape.png",
        f"file://{media_root}/%2e%2e/%2e%2e/etc/passwd",
        f"file://{media_root}\\..\\x.png",
        f"file://otherhost{media_root}/ok.png",
        f"file://{media_root}/ok.png?x=1",
    ):
        with pytest.raises(MediaError):
            loader.load_image(url)


def test_outside_the_root_an_existing_file_and_a_missing_one_get_the_same_answer(
    media_root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "secret.png"
    random_image(8, 8).save(outside)
    loader = _loader(media_root)
    pairs = [
        (f"file://{outside}", f"file://{tmp_path}/no-such.png"),
        (f"file://{media_root}/../secret.png", f"file://{media_root}/../no-such.png"),
        ("file:///etc/passwd", "file:///etc/no-such-file"),
        # through a symlink under the root that points out of it
        (f"file://{media_root}/escape_dir/passwd", f"file://{media_root}/escape_dir/no-such"),
    ]
    for existing, missing in pairs:
        seen = _error(loader, existing)
        unseen = _error(loader, missing)
        assert type(seen) is type(unseen) is MediaFetchRefusedError, (existing, missing)
        assert (seen.message, seen.param, seen.code) == (unseen.message, unseen.param, unseen.code)
        assert "outside --allowed-local-media-path" in seen.message


def test_inside_the_root_a_missing_file_is_named_missing(media_root: Path) -> None:
    loader = _loader(media_root)
    err = _error(loader, f"file://{media_root}/no-such.png")
    assert "names no file" in err.message and err.param == "image_url"
    assert "does not name a regular file" in _error(loader, f"file://{media_root}/sub").message
    too_long = _error(loader, f"file://{media_root}/{'n' * 5000}.png")  # ENAMETOOLONG
    assert too_long.status_code == 400 and too_long.param == "image_url"


@pytest.mark.parametrize(
    "suffix",
    ["/ok.png\x00.txt", "/ok.png%00.txt", "/%00", "/ok%0a.png", "/%ff%fe.png", "/ok.png\x7f"],
)
def test_nul_control_and_undecodable_paths_are_a_400(media_root: Path, suffix: str) -> None:
    err = _error(_loader(media_root), f"file://{media_root}{suffix}")
    assert err.status_code == 400 and err.param == "image_url"
    assert "file:// URL" in err.message
