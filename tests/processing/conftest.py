"""Fixtures of the remote-mode tests (test_remote_planning.py, test_remote_urls.py): a local and a
remote InputProcessor over one media root, the fake UrlPlanner, and a guard against decoding."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mmserve.processing import image_decode
from mmserve.processing.input_processor import InputProcessor
from tests.processing.remote_helpers import FakePlanner, make_planner, make_processor, refuse_decode


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def planner(qwen2_vl_dir: Path) -> FakePlanner:
    return make_planner(qwen2_vl_dir)


@pytest.fixture(scope="module")
def local(qwen2_vl_dir: Path, media_root: Path) -> Iterator[InputProcessor]:
    proc = make_processor(qwen2_vl_dir, media_root, None)
    yield proc
    proc.media_loader.close()


@pytest.fixture(scope="module")
def remote(qwen2_vl_dir: Path, media_root: Path, planner: FakePlanner) -> Iterator[InputProcessor]:
    proc = make_processor(qwen2_vl_dir, media_root, planner)
    yield proc
    proc.media_loader.close()


@pytest.fixture
def no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any image decode in this process fails the test (remote planning reads headers only)."""
    monkeypatch.setattr(image_decode, "decode_first_frame", refuse_decode)
