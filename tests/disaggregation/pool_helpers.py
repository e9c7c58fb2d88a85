"""The encoder-pool tests' items, waits and routing order (tests/disaggregation/test_pool*.py);
their fake encoders are tests/support/fake_encoder.py, their fixtures conftest.py."""

from __future__ import annotations

import time

import numpy as np

from mmserve.disaggregation.discovery import ModelIdentity
from mmserve.disaggregation.pool import RemoteEncoderPool
from mmserve.disaggregation.protocol import content_digest
from mmserve.metrics import EngineMetrics
from mmserve.multimodal import MultiModalFeature, PlaceholderRange, RemoteItem
from mmserve.routing import rendezvous_order
from tests.support.fake_encoder import FINGERPRINT, HIDDEN, FakeEncoder

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
