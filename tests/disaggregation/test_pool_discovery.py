"""Pairing a language server with its encoders (discovery) and the pool's configuration."""

from __future__ import annotations

import re

import pytest

from mmserve.disaggregation.discovery import ModelIdentity, discover
from mmserve.disaggregation.pool import PoolConfig, RemoteEncoderPool
from mmserve.disaggregation.protocol import ENCODER_PROTOCOL_VERSION
from mmserve.metrics import EngineMetrics
from tests.disaggregation.pool_helpers import (
    IDENTITY,
    collect,
    remote,
)
from tests.support.fake_encoder import (
    FINGERPRINT,
    HIDDEN,
)


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
