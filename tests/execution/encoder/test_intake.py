"""RemoteItemIntake: what the runner sent, what it takes back, and what it refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.errors import FailureKind
from mmserve.execution.encoder.cache import EncoderCache
from mmserve.execution.encoder.intake import RemoteItemIntake
from mmserve.execution.encoder.runner import EncodeJob, EncoderRunner
from mmserve.multimodal import EncoderInput, MultiModalFeature, PlaceholderRange, RemoteItem
from tests.support.factory import LEVELS_AS_FLOATS
from tests.support.fake_encoder_source import FakeEncoderSource

HIDDEN = 3
GRID = (1, 2, 4)  # 8 patches merged 2x2: 2 embeddings


def _embed_rows(pixels: torch.Tensor, grids):  # [8 * n, 3] -> two [2, HIDDEN] per item
    return [pixels[i * 8 : i * 8 + 2, :1].repeat(1, HIDDEN) for i in range(len(grids))]


def _setup(embeddings: torch.Tensor | None = None):
    encoder = EncoderRunner(
        _embed_rows, EncoderCache(torch.device("cpu"), torch.float32), max_patches_per_call=64
    )
    source = FakeEncoderSource(lambda p: embeddings if embeddings is not None else torch.ones(2, 3))
    return encoder, source, RemoteItemIntake(source, encoder, HIDDEN)


def _feature(identifier: str) -> MultiModalFeature:
    return MultiModalFeature(identifier, "image", PlaceholderRange(3, 2), GRID, is_remote=True)


def _remote_item(identifier: str) -> RemoteItem:
    """Every item's bytes, as the executor side's store hands them to the intake."""
    return RemoteItem("bytes", b"img", None, None, 3136, 1 << 20, GRID, "d" * 64)


def _pixels(grid=GRID) -> EncoderInput:
    return EncoderInput(np.arange(24, dtype=np.uint8).reshape(8, 3), grid, LEVELS_AS_FLOATS)


def test_embeddings_are_checked_moved_to_the_cache_dtype_and_reported_once() -> None:
    encoder, source, intake = _setup(torch.ones(2, HIDDEN, dtype=torch.float64))
    source.register("a", _pixels())
    assert intake.submit({"r1": [_feature("a")], "r2": [_feature("a")]}, _remote_item) == {}
    assert source.submitted == [("r1", "a")]  # pending: not sent twice
    results = intake.collect()
    assert results.arrived == ["a"] and not results.failed
    assert encoder.cache.get("a").dtype == torch.float32 and not intake.pending


def test_embeddings_of_the_wrong_shape_or_dtype_fail_the_item_and_stay_out() -> None:
    for bad in (torch.ones(3, HIDDEN), torch.ones(2, HIDDEN + 1), torch.ones(2, HIDDEN).int()):
        encoder, source, intake = _setup(bad)
        source.register("a", _pixels())
        intake.submit({"r": [_feature("a")]}, _remote_item)
        results = intake.collect()
        assert not results.arrived and "a" not in encoder.cache
        failure = results.failed["a"]
        assert failure.kind is FailureKind.INTERNAL and "expected floating point [2, 3]" in (
            failure.message
        )


def test_fallback_pixels_are_encoded_here_and_a_wrong_grid_fails() -> None:
    encoder, source, intake = _setup()
    source.register("a", _pixels())
    source.register("b", _pixels((1, 4, 2)))
    source.fallback = {"a", "b"}
    intake.submit({"r": [_feature("a"), _feature("b")]}, _remote_item)
    results = intake.collect()
    # the local tower's answer: rows 0 and 1 of the pixels' first column, widened
    assert results.arrived == ["a"]
    assert torch.equal(encoder.cache.get("a"), torch.tensor([[0.0] * HIDDEN, [3.0] * HIDDEN]))
    assert "grid (1, 4, 2)" in results.failed["b"].message and "b" not in encoder.cache


def test_a_cancelled_item_is_cancelled_at_the_source_and_its_late_reply_dropped() -> None:
    encoder, source, intake = _setup()
    source.answers_after_cancel = True
    source.register("a", _pixels())
    intake.submit({"r": [_feature("a")]}, _remote_item)
    intake.cancel(["a", "never-sent"])
    assert source.cancelled == ["a"]  # only what is pending goes to the source
    results = intake.collect()
    assert not results.arrived and not results.failed and "a" not in encoder.cache
    assert intake.num_dropped == 1


def test_without_a_source_a_remote_item_fails_with_an_internal_error() -> None:
    encoder = EncoderRunner(
        _embed_rows, EncoderCache(torch.device("cpu"), torch.float32), max_patches_per_call=64
    )
    intake = RemoteItemIntake(None, encoder, HIDDEN)
    failed = intake.submit({"r": [_feature("a")]}, _remote_item)
    assert failed["a"].kind is FailureKind.INTERNAL
    assert "encoder pool" in failed["a"].message and "request r" in failed["a"].message
    intake.wait(10.0)  # nothing in flight: returns at once
    assert intake.collect().arrived == []


def test_a_local_encode_refuses_a_remote_item() -> None:
    encoder, _, _ = _setup()
    with pytest.raises(RuntimeError, match="no pixels"):
        encoder.encode([EncodeJob(_feature("a"), None)])


def test_deepstack_rows_are_taken_whole_and_a_row_without_its_levels_is_refused() -> None:
    """With L DeepStack levels a row is HIDDEN x (1 + L) wide: the cache keeps all of it (its
    bytes are what the scheduler's ledger counts), and the main embedding alone does not fit."""
    levels = 2
    width = HIDDEN * (1 + levels)
    rows = torch.arange(2 * width, dtype=torch.float32).reshape(2, width)
    for sent, fits in ((rows, True), (rows[:, :HIDDEN], False)):
        encoder, source, _ = _setup(sent)
        intake = RemoteItemIntake(source, encoder, width)
        source.register("a", _pixels())
        intake.submit({"r": [_feature("a")]}, _remote_item)
        results = intake.collect()
        if fits:
            assert results.arrived == ["a"] and torch.equal(encoder.cache.get("a"), rows)
            assert encoder.cache.num_bytes == 2 * HIDDEN * (1 + levels) * 4  # float32
        else:
            assert not results.arrived and "a" not in encoder.cache
            assert f"expected floating point [2, {width}]" in results.failed["a"].message
