"""RemoteEncoderPool against fake encoders: arrivals, routing by identity and load, timeouts,
retries, fallback (faults: test_pool_faults.py; discovery: test_pool_discovery.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from PIL import Image

from mmserve.disaggregation.discovery import ModelIdentity
from mmserve.disaggregation.local_fallback import LocalFallback
from mmserve.errors import FailureKind
from mmserve.metrics import EngineMetrics
from mmserve.processing.image_processor import ImageProcessorConfig, process_image
from mmserve.processing.media import MediaLoader
from tests.disaggregation.pool_helpers import (
    RGB,
    collect,
    feature,
    labelled,
    remote,
    tried_first,
    wait_until,
)
from tests.support.fake_encoder import (
    FINGERPRINT,
    HIDDEN,
    expected_embeddings,
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embeddings_arrive_exactly_and_are_counted(fakes, pools, dtype):
    (a,) = fakes(1)
    a.behaviour.dtype = dtype
    # The answer waits, so the first item is still pending when the second submit comes (a
    # local round trip can otherwise finish between the two calls, and the item is sent again).
    a.behaviour.reply_delay_s = 1.0
    metrics = EngineMetrics()
    pool = pools([a], metrics=metrics, timeout_s=10.0)
    pool.submit("r1", *remote(1))
    pool.submit("r1", *remote(1))  # already pending: not sent twice
    assert pool.num_pending() == 1
    arrivals, failures = collect(pool, 1)
    assert failures == [] and len(arrivals) == 1 and pool.num_pending() == 0
    want = torch.from_numpy(expected_embeddings(feature(1).identifier, (1, 4, 4)))
    got = arrivals[0].embeddings
    assert got.dtype == getattr(torch, dtype) and got.shape == (4, HIDDEN)
    assert torch.equal(got, want.to(got.dtype)) and arrivals[0].encoder == a.url
    assert len(a.items) == 1 and a.items[0].request_id == "r1"
    transfer = labelled(metrics, "embedding_transfer_bytes")
    assert transfer == {"sent": len(RGB), "received": 4 * HIDDEN * got.element_size()}
    assert labelled(metrics, "remote_encoder_items") == {a.url: 1}
    assert labelled(metrics, "remote_encoder_latency_seconds")[a.url] > 0


@pytest.mark.parametrize("levels", [1, 3])
def test_deepstack_rows_arrive_whole_and_every_level_is_counted(fakes, pools, levels):
    """A DeepStack model's rows are HIDDEN x (1 + levels) wide: they cross whole, and the
    received bytes are tokens x HIDDEN x (1 + levels) x the dtype's size."""
    width = HIDDEN * (1 + levels)
    (a,) = fakes(1)
    a.behaviour.embedding_width = width
    metrics = EngineMetrics()
    pool = pools([a], metrics=metrics, identity=ModelIdentity(FINGERPRINT, width, "float32"))
    pool.submit("r1", *remote(1))
    arrivals, failures = collect(pool, 1)
    assert failures == [] and len(arrivals) == 1
    want = expected_embeddings(feature(1).identifier, (1, 4, 4), width)
    assert torch.equal(arrivals[0].embeddings, torch.from_numpy(want))
    received = labelled(metrics, "embedding_transfer_bytes")["received"]
    assert received == 4 * HIDDEN * (1 + levels) * 4  # 4 tokens, float32


def test_a_reply_without_the_deepstack_levels_is_refused(fakes, pools):
    """An encoder that answers the main embedding alone (rows HIDDEN wide) to a model whose
    rows carry 2 levels is refused: the item fails, nothing is counted as received."""
    width = HIDDEN * 3
    (a,) = fakes(1)
    a.behaviour.embedding_width = HIDDEN
    metrics = EngineMetrics()
    identity = ModelIdentity(FINGERPRINT, width, "float32")
    pool = pools([a], metrics=metrics, identity=identity)
    pool.submit("r1", *remote(1))
    arrivals, failures = collect(pool, 1)
    assert arrivals == [] and len(failures) == 1
    message = failures[0].failure.message
    assert f"embedding rows of width {HIDDEN}, the model's are {width} wide" in message
    assert labelled(metrics, "remote_encoder_dropped_messages")["bad_payload"] == 1
    assert labelled(metrics, "embedding_transfer_bytes")["received"] == 0


def test_fan_out_by_input_patches_not_by_count(fakes, pools):
    a, b = tried_first(fakes(2), 1)
    a.behaviour.mode = b.behaviour.mode = "hang"  # nothing finishes: loads only grow
    pool = pools([a, b], timeout_s=5.0)
    # 40,000 patches: a 4K image (beyond routing.AFFINITY_SLACK, so it outweighs the affinity)
    pool.submit("r1", *remote(1, grid=(1, 200, 200)))
    for n in range(2, 5):
        pool.submit("r1", *remote(n, grid=(1, 4, 4)))  # 16 patches each: thumbnails
    assert wait_until(lambda: len(a.items) + len(b.items) == 4)
    assert [i.item.grid_thw for i in a.items] == [(1, 200, 200)]
    assert len(b.items) == 3 and {i.item_index for i in b.items} == {1, 2, 3}


def test_fan_out_counts_the_encoders_own_queue(fakes, pools):
    a, b = fakes(2)
    a.behaviour.queued_patches = 100_000  # busy with other servers' work, beyond the slack
    pool = pools([a, b])
    # the pool sends a ping only after handling what arrived before it: its first pong is in
    assert wait_until(lambda: a.pings >= 3)
    for n in range(1, 4):
        pool.submit("r1", *remote(n))
    assert len(collect(pool, 3)[0]) == 3
    assert len(a.items) == 0 and len(b.items) == 3


def test_a_hanging_encoder_times_out_and_the_item_is_retried_on_the_other(fakes, pools):
    a, b = tried_first(fakes(2), 1)
    a.behaviour.mode = "hang"
    metrics = EngineMetrics()
    pool = pools([a, b], metrics=metrics, timeout_s=0.3)
    start = time.monotonic()
    pool.submit("r1", *remote(1))
    arrivals, failures = collect(pool, 1)
    assert failures == [] and [x.encoder for x in arrivals] == [b.url]
    assert 0.25 < time.monotonic() - start < 10.0  # generous: a loaded CI machine
    assert metrics.snapshot().counters["remote_encoder_retries"] == 1
    assert wait_until(lambda: a.cancels)  # the hung attempt is cancelled there
    assert a.cancels[0].identifiers == [feature(1).identifier]


def test_an_encoder_killed_mid_item_leaves_rotation_and_the_item_moves(fakes, pools):
    a, b = tried_first(fakes(2), 1)
    a.behaviour.mode = "hang"
    pool = pools([a, b], timeout_s=30.0)  # the missed pings notice it, not the item's deadline
    pool.submit("r1", *remote(1))
    assert a.wait_for_items(1)
    a.close()
    arrivals, failures = collect(pool, 1)
    assert failures == [] and [x.encoder for x in arrivals] == [b.url]


def test_an_internal_error_is_retried_elsewhere_and_an_input_error_is_not(fakes, pools):
    a, b = tried_first(fakes(2), 1)
    a.behaviour.mode = "error"
    pool = pools([a, b])
    pool.submit("r1", *remote(1))
    arrivals, _ = collect(pool, 1)
    assert [x.encoder for x in arrivals] == [b.url] and len(a.items) == 1
    b.behaviour.mode = "error"
    b.behaviour.error_code = "invalid_image"
    a.behaviour.error_code = "invalid_image"
    pool.submit("r2", *remote(2))
    _, failures = collect(pool, 1)
    assert len(failures) == 1 and failures[0].failure.kind is FailureKind.REQUEST
    assert "fake invalid_image" in failures[0].failure.message
    assert "request r2" in failures[0].failure.message
    assert len(a.items) + len(b.items) == 3  # one send for r2: no retry of an input fault


@pytest.mark.parametrize("mode", ["hang", "error"])
def test_all_encoders_down_fail_mode_is_a_503_kind_failure_within_the_timeouts(fakes, pools, mode):
    encoders = tried_first(fakes(2), 1)  # the last one tried names the failure
    for fake in encoders:
        fake.behaviour.mode = mode
    pool = pools(encoders, timeout_s=0.3)
    start = time.monotonic()
    pool.submit("req-7", *remote(1))
    arrivals, failures = collect(pool, 1)
    assert arrivals == [] and len(failures) == 1
    assert time.monotonic() - start < 15.0  # one 0.3 s attempt per encoder, then the end
    failure = failures[0].failure
    assert failure.kind is FailureKind.UNAVAILABLE
    assert failure.message.startswith("no encoder could encode image item 0")
    assert "request req-7" in failure.message and encoders[1].url in failure.message
    assert pool.num_pending() == 0


def test_all_encoders_down_local_fallback_returns_the_local_pixels(fakes, pools):
    (a,) = fakes(1)
    a.behaviour.mode = "error"
    metrics = EngineMetrics()
    local = LocalFallback(MediaLoader(), ImageProcessorConfig())
    pool = pools([a], metrics=metrics, local=local, fallback="local")
    pool.submit("r1", *remote(1))
    arrivals, failures = collect(pool, 1)
    assert failures == [] and len(arrivals) == 1
    arrival = arrivals[0]
    assert arrival.encoder == "local" and arrival.embeddings is None
    image = Image.fromarray(np.frombuffer(RGB, np.uint8).reshape(56, 56, 3), "RGB")
    want = process_image(image, ImageProcessorConfig())
    assert arrival.pixels.grid_thw == (1, 4, 4)
    np.testing.assert_array_equal(arrival.pixels.pixel_values, want.pixel_values)
    assert metrics.snapshot().counters["remote_encoder_fallbacks"] == 1


def test_local_fallback_fails_an_item_whose_grid_differs_from_the_plan(fakes, pools):
    (a,) = fakes(1)
    a.behaviour.mode = "error"
    local = LocalFallback(MediaLoader(), ImageProcessorConfig())
    pool = pools([a], local=local, fallback="local")
    pool.submit("r1", *remote(1, grid=(1, 8, 8)))
    _, failures = collect(pool, 1)
    assert len(failures) == 1 and failures[0].failure.kind is FailureKind.REQUEST
    assert "planned as (1, 8, 8)" in failures[0].failure.message
