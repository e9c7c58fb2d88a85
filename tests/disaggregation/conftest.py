"""Fixtures of the encoder-pool tests: fake encoders and pools over them, closed after."""

from __future__ import annotations

import pytest

from mmserve.disaggregation.discovery import EncoderEndpoint
from mmserve.disaggregation.pool import PoolConfig, RemoteEncoderPool
from mmserve.metrics import EngineMetrics
from tests.disaggregation.pool_helpers import IDENTITY
from tests.support.fake_encoder import FakeEncoder


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
