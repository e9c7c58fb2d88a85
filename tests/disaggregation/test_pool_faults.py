"""RemoteEncoderPool against misbehaving encoders: silence and rotation, duplicate, stale,
garbage and foreign-signed replies, cancels, oversize headers, a dead I/O thread."""

from __future__ import annotations

import time

from mmserve.errors import FailureKind
from mmserve.metrics import EngineMetrics
from mmserve.multimodal import MultiModalFeature, PlaceholderRange, RemoteItem
from tests.disaggregation.pool_helpers import (
    collect,
    feature,
    items_first_on,
    labelled,
    remote,
    wait_until,
)


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


def test_an_encoder_taken_out_again_and_again_waits_longer_each_time():
    from mmserve.disaggregation.pool_state import MAX_REJOIN_BACKOFF_S, rejoin_backoff_s

    waits = [rejoin_backoff_s(n, 0.5) for n in range(1, 9)]
    assert waits[:5] == [0.0, 1.0, 2.0, 4.0, 8.0]  # the first time: back on its next pong
    assert waits[-1] == MAX_REJOIN_BACKOFF_S and waits == sorted(waits)


def test_a_pause_of_the_pools_own_thread_is_not_an_encoders_silence(fakes):
    """Silence counts from a ping that went out: a server paused for longer than the window (a
    loaded machine) sent no pings, so its encoders stay in rotation; a ping left unanswered for
    the window still takes one out. (The I/O thread's steps, driven with a made-up clock.)"""
    import zmq

    from mmserve.disaggregation.discovery import EncoderEndpoint
    from mmserve.disaggregation.pool_io import PoolIO
    from mmserve.disaggregation.pool_state import IOConfig
    from mmserve.disaggregation.protocol import Pong
    from tests.disaggregation.pool_helpers import IDENTITY
    from tests.support.fake_encoder import FINGERPRINT

    (a,) = fakes(1)
    config = IOConfig(IDENTITY, 5.0, None, ping_interval_s=0.5, missed_pings=6, send_hwm=8)
    ctx = zmq.Context()
    io = PoolIO(ctx, [EncoderEndpoint(a.url, a.zmq_address)], config, None, EngineMetrics(),
                f"inproc://pause-{id(ctx)}")  # fmt: skip
    try:
        (link,) = io.links
        t0 = time.monotonic()
        io._ping(t0)
        io._on_pong(link, Pong(link.ping_nonce, 0, FINGERPRINT))
        io._ping(t0 + 60.0)  # the thread slept a minute: no ping went out meanwhile
        assert link.is_healthy
        io._ping(t0 + 60.0 + 2.9)  # that ping unanswered for less than 6 x 0.5 s
        assert link.is_healthy
        io._ping(t0 + 60.0 + 3.1)
        assert not link.is_healthy
        io._ping(t0 + 64.0)
        io._on_pong(link, Pong(link.ping_nonce, 0, FINGERPRINT))  # answers a later ping: back
        assert link.is_healthy and link.unanswered_since_s is None
    finally:
        for link in io.links:
            link.socket.close(linger=0)
        io.wake.close(linger=0)
        ctx.term()
