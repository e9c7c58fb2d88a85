"""RemoteEncoderPool against fake encoders: fan-out, timeouts, retries, fallback, drops."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch
from PIL import Image

from mmserve.disaggregation.discovery import EncoderEndpoint, ModelIdentity, discover
from mmserve.disaggregation.local_fallback import LocalFallback
from mmserve.disaggregation.pool import PoolConfig, RemoteEncoderPool
from mmserve.disaggregation.protocol import ENCODER_PROTOCOL_VERSION, content_digest
from mmserve.errors import FailureKind
from mmserve.metrics import EngineMetrics
from mmserve.multimodal import MultiModalFeature, PlaceholderRange, RemoteItem
from mmserve.processing.image_processor import ImageProcessorConfig, process_image
from mmserve.processing.media import MediaLoader
from mmserve.routing import rendezvous_order
from tests.support.fake_encoder import (
    FINGERPRINT,
    HIDDEN,
    FakeEncoder,
    expected_embeddings,
)

IDENTITY = ModelIdentity(FINGERPRINT, HIDDEN, "float32")
RGB_SIZE = (56, 56)  # 56x56 under the default processor: a (1, 4, 4) grid, 4 embeddings
RGB = np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8).tobytes()


def feature(n: int, grid: tuple[int, int, int] = (1, 4, 4), offset: int = 3) -> MultiModalFeature:
    num_embeds = grid[0] * grid[1] * grid[2] // 4
    placeholder = PlaceholderRange(offset, num_embeds)
    return MultiModalFeature(f"{n:04x}" + "ab" * 30, "image", placeholder, grid, is_remote=True)


def remote(n: int, grid: tuple[int, int, int] = (1, 4, 4), offset: int = 3):
    """What `pool.submit` takes for item n: its spec and its RemoteItem (an RGB array)."""
    item = RemoteItem("rgb", RGB, None, RGB_SIZE, 3136, 12845056, grid, content_digest(RGB))
    return feature(n, grid, offset), item


def tried_first(encoders: list[FakeEncoder], n: int = 1) -> list[FakeEncoder]:
    """`encoders` in the order the pool tries them for item n when their loads are equal: it
    ranks them by rendezvous hashing on the item's identity (mmserve/routing.py), and their
    URLs hold random ports, so a test that needs one encoder met first orders them by this."""
    order = rendezvous_order(feature(n).identifier, [e.url for e in encoders])
    return [encoders[i] for i in order]


def items_first_on(encoder: FakeEncoder, encoders: list[FakeEncoder], count: int) -> list[int]:
    """The first `count` item numbers that `encoder` is tried first for among `encoders`."""
    found: list[int] = []
    n = 0
    while len(found) < count:
        n += 1
        if tried_first(encoders, n)[0] is encoder:
            found.append(n)
    return found


@pytest.fixture
def fakes(request):
    made: list[FakeEncoder] = []

    def make(count: int = 2, **kw) -> list[FakeEncoder]:
        made.extend(FakeEncoder(**kw) for _ in range(count))
        return made[-count:]

    yield make
    for fake in made:
        fake.close()


@pytest.fixture
def pools():
    made: list[RemoteEncoderPool] = []

    def make(encoders, *, metrics=None, local=None, identity=IDENTITY, **kw) -> RemoteEncoderPool:
        # pings every 50 ms; silent for 0.5 s (a starved CI machine's pause is shorter) is out
        defaults = {
            "fallback": "fail",
            "timeout_s": 0.5,
            "ping_interval_s": 0.05,
            "missed_pings": 10,
        }
        kw = defaults | kw
        config = PoolConfig(tuple(f.url for f in encoders), identity, **kw)
        endpoints = [EncoderEndpoint(f.url, f.zmq_address) for f in encoders]
        pool = RemoteEncoderPool(
            config, endpoints, metrics=metrics or EngineMetrics(), local_fallback=local
        )
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.shutdown()


def collect(pool: RemoteEncoderPool, count: int, timeout_s: float = 15.0):
    arrivals, failures = [], []
    deadline = time.monotonic() + timeout_s
    while len(arrivals) + len(failures) < count and time.monotonic() < deadline:
        pool.wait(0.05)
        got, failed = pool.poll()
        arrivals += got
        failures += failed
    return arrivals, failures


def labelled(metrics: EngineMetrics, name: str) -> dict[str, float]:
    return metrics.snapshot().labelled_counters[name]


def wait_until(check, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return check()


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


def test_a_silent_encoder_leaves_rotation_and_comes_back_when_it_answers(fakes, pools):
    a, b = fakes(2)
    first, again = items_first_on(a, [a, b], 2)
    a.behaviour.answer_pings = False
    metrics = EngineMetrics()
    pool = pools([a, b], metrics=metrics)
    gauge = lambda: metrics.snapshot().gauges["remote_encoder_healthy"]  # noqa: E731
    assert wait_until(lambda: gauge() == 1)
    pool.submit("r1", *remote(first))  # a would be tried first: it is out of rotation
    assert [x.encoder for x in collect(pool, 1)[0]] == [b.url]
    a.behaviour.answer_pings = True
    assert wait_until(lambda: gauge() == 2)
    pool.submit("r2", *remote(again))  # equal loads: the first-ranked encoder again
    assert [x.encoder for x in collect(pool, 1)[0]] == [a.url]


def test_duplicate_and_stale_replies_are_dropped_and_counted(fakes, pools):
    a, b = fakes(2)
    n1, n2, n3 = items_first_on(a, [a, b], 3)
    a.behaviour.mode = "twice"
    metrics = EngineMetrics()
    pool = pools([a, b], metrics=metrics, timeout_s=0.3)
    pool.submit("r1", *remote(n1))
    assert len(collect(pool, 1)[0]) == 1
    dropped = lambda: labelled(metrics, "remote_encoder_dropped_messages")  # noqa: E731
    assert wait_until(lambda: dropped().get("duplicate") == 1)
    a.behaviour.mode = "ok"
    a.behaviour.reply_delay_s = 0.6  # answers after the item moved to b
    pool.submit("r2", *remote(n2))
    arrivals, _ = collect(pool, 1)
    assert [x.encoder for x in arrivals] == [b.url]
    assert wait_until(lambda: dropped().get("stale") == 1)
    a.behaviour.reply_delay_s = 0.0
    a.behaviour.mode = "stale_first"  # first an attempt number this item never had
    assert wait_until(lambda: metrics.snapshot().gauges["remote_encoder_healthy"] == 2)
    pool.submit("r3", *remote(n3))
    assert [x.encoder for x in collect(pool, 1)[0]] == [a.url]
    assert wait_until(lambda: dropped().get("unknown") == 1)
    assert pool.poll() == ([], [])  # nothing dropped ever reaches the runner


def test_garbage_truncated_and_unsigned_frames_are_dropped_and_the_pool_goes_on(fakes, pools):
    (a,) = fakes(1, secret=b"k3y")
    a.behaviour.mode = "garbage_first"
    metrics = EngineMetrics()
    pool = pools([a], metrics=metrics, secret=b"k3y")
    pool.submit("r1", *remote(1))
    arrivals, failures = collect(pool, 1)
    assert failures == [] and len(arrivals) == 1
    dropped = labelled(metrics, "remote_encoder_dropped_messages")
    assert dropped == {"bad_mac": 3, "frame_count": 1}
    a.behaviour.mode = "bad_payload"  # a result whose bytes do not fit its shape
    pool.submit("r2", *remote(2))
    _, failures = collect(pool, 1)
    assert len(failures) == 1 and "payload bytes" in failures[0].failure.message
    assert labelled(metrics, "remote_encoder_dropped_messages")["bad_payload"] == 1


def test_replies_signed_with_another_secret_are_dropped(fakes, pools):
    (a,) = fakes(1, secret=b"shared")
    a.behaviour.sign_with = b"not-the-shared-one"
    metrics = EngineMetrics()
    pool = pools([a], metrics=metrics, secret=b"shared", timeout_s=0.3)
    pool.submit("r1", *remote(1))
    arrivals, failures = collect(pool, 1)
    assert arrivals == [] and failures[0].failure.kind is FailureKind.UNAVAILABLE
    assert labelled(metrics, "remote_encoder_dropped_messages")["bad_mac"] >= 1


def test_cancel_stops_a_pending_item_and_its_late_reply_is_dropped(fakes, pools):
    (a,) = fakes(1)
    a.behaviour.reply_delay_s = 0.2
    metrics = EngineMetrics()
    pool = pools([a], metrics=metrics)
    pool.submit("r1", *remote(1))
    assert a.wait_for_items(1)
    pool.cancel([feature(1).identifier, "never-submitted"])
    assert pool.num_pending() == 0
    assert wait_until(lambda: a.cancels)
    assert a.cancels[0].attempts == [a.items[0].attempt]
    dropped = lambda: labelled(metrics, "remote_encoder_dropped_messages")  # noqa: E731
    assert wait_until(lambda: dropped().get("cancelled") == 1)
    assert pool.poll() == ([], [])
    a.behaviour.reply_delay_s = 0.0
    pool.submit("r2", *remote(2))
    assert wait_until(lambda: pool.num_pending() == 0)  # arrived, not polled yet
    pool.cancel(iter([feature(2).identifier]))  # its request went away meanwhile
    assert pool.poll() == ([], [])


def test_an_item_too_large_for_a_message_header_fails_alone(fakes, pools):
    (a,) = fakes(1)
    pool = pools([a])
    url = "https://img.example/" + "x" * (70 * 1024)
    item = RemoteItem("url", None, url, None, 3136, 12845056, (1, 4, 4), "d" * 64)
    spec = MultiModalFeature("e" * 64, "image", PlaceholderRange(0, 4), (1, 4, 4), is_remote=True)
    pool.submit("r1", spec, item)
    _, failures = collect(pool, 1)
    failure = failures[0].failure
    assert failure.kind is FailureKind.REQUEST and "header" in failure.message
    pool.submit("r2", *remote(2))  # the pool goes on
    assert len(collect(pool, 1)[0]) == 1 and a.items[0].request_id == "r2"


def test_a_dead_io_thread_fails_every_pending_item_and_every_later_one(fakes, pools):
    (a,) = fakes(1)
    a.behaviour.mode = "hang"
    pool = pools([a], timeout_s=5.0)
    pool.submit("r1", *remote(1))
    pool.io_failed("RuntimeError in the encoder pool's I/O thread")  # what its thread reports
    pool.submit("r2", *remote(2))
    _, failures = collect(pool, 2)
    assert [f.identifier for f in failures] == [feature(1).identifier, feature(2).identifier]
    assert {f.failure.kind for f in failures} == {FailureKind.INTERNAL}
    assert pool.num_pending() == 0


def test_discovery_refuses_an_encoder_of_another_model(fakes):
    (a,) = fakes(1)
    assert discover(a.url, IDENTITY, secret=None, timeout_s=2).zmq_address == a.zmq_address
    a.behaviour.fingerprint = "0" * 64
    with pytest.raises(ValueError, match=f"encoder {a.url} serves another checkpoint"):
        discover(a.url, IDENTITY, secret=None, timeout_s=2)
    a.behaviour.fingerprint = FINGERPRINT
    with pytest.raises(ValueError, match="rows of width 8, this model needs 16"):
        discover(a.url, ModelIdentity(FINGERPRINT, 16, "float32"), secret=None, timeout_s=2)
    with pytest.raises(ValueError, match="encodes in float32, this server runs bfloat16"):
        discover(a.url, ModelIdentity(FINGERPRINT, HIDDEN, "bfloat16"), secret=None, timeout_s=2)


def test_discovery_refuses_an_encoder_without_the_models_deepstack_levels(fakes):
    (a,) = fakes(1)
    deep = ModelIdentity(FINGERPRINT, HIDDEN * 4, "float32")  # 3 DeepStack levels
    expected = (
        f"encoder {a.url} returns embedding rows of width {HIDDEN}, this model needs "
        f"{HIDDEN * 4} (hidden size x (1 + DeepStack levels))"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        discover(a.url, deep, secret=None, timeout_s=2)
    a.behaviour.embedding_width = HIDDEN * 4
    assert discover(a.url, deep, secret=None, timeout_s=2).zmq_address == a.zmq_address


def test_discovery_refuses_an_encoder_of_another_protocol_version(fakes):
    """Version 1 named the width `hidden_size` (and did not name its version)."""
    (a,) = fakes(1)
    a.behaviour.protocol_version = None
    with pytest.raises(ValueError, match=f"encoder {a.url} speaks encoder protocol 1, this"):
        discover(a.url, IDENTITY, secret=None, timeout_s=2)
    a.behaviour.protocol_version = ENCODER_PROTOCOL_VERSION + 1
    with pytest.raises(ValueError, match="run the same mmserve version on both"):
        discover(a.url, IDENTITY, secret=None, timeout_s=2)


def test_discovery_names_a_secret_mismatch_and_a_missing_encoder(fakes):
    (a,) = fakes(1, secret=b"right")
    with pytest.raises(ValueError, match="secret differs"):
        discover(a.url, IDENTITY, secret=b"wrong", timeout_s=2)
    with pytest.raises(ValueError, match="did not answer GET /v1/encode/info within 0.3 s"):
        discover("http://127.0.0.1:9", IDENTITY, secret=None, timeout_s=0.3)


def test_start_discovers_then_encodes(fakes):
    (a,) = fakes(1, secret=b"s")
    config = PoolConfig((a.url,), IDENTITY, fallback="fail", secret=b"s", timeout_s=1.0)
    pool = RemoteEncoderPool.start(config, metrics=EngineMetrics())
    try:
        pool.submit("r1", *remote(1))
        assert len(collect(pool, 1)[0]) == 1
    finally:
        pool.shutdown()
        pool.shutdown()  # idempotent


def test_pool_config_refuses_bad_values():
    with pytest.raises(ValueError, match="--encoder-urls 'localhost'"):
        PoolConfig(("localhost",), IDENTITY)
    with pytest.raises(ValueError, match="names an encoder twice"):
        PoolConfig(("http://a:1", "http://a:1/"), IDENTITY)
    with pytest.raises(ValueError, match="--encoder-fallback"):
        PoolConfig(("http://a:1",), IDENTITY, fallback="maybe")
    with pytest.raises(ValueError, match="needs the local CPU stage"):
        RemoteEncoderPool(PoolConfig(("http://a:1",), IDENTITY), [], metrics=EngineMetrics())


def test_an_encoder_taken_out_again_and_again_waits_longer_each_time():
    from mmserve.disaggregation.pool_state import MAX_REJOIN_BACKOFF_S, rejoin_backoff_s

    waits = [rejoin_backoff_s(n, 0.5) for n in range(1, 9)]
    assert waits[:5] == [0.0, 1.0, 2.0, 4.0, 8.0]  # the first time: back on its next pong
    assert waits[-1] == MAX_REJOIN_BACKOFF_S and waits == sorted(waits)
