"""`serve --encoder-*`: flags, validation, the secret, and the engine core wired to the pool."""

from __future__ import annotations

import msgspec
import pytest

from mmserve.cli import build_parser
from mmserve.config.engine import EngineConfig
from mmserve.config.pool import EncoderPoolConfig
from mmserve.disaggregation.pool import RemoteEncoderPool
from mmserve.disaggregation.protocol import model_fingerprint
from mmserve.engine.core.build import build_core
from mmserve.engine.remote_encoders import read_encoder_secret
from mmserve.engine.shape import resolve_shape
from mmserve.metrics import EngineMetrics
from mmserve.models.config import load_model_config
from tests.support.config_args import configs_of, serve_configs_of
from tests.support.fake_encoder import FakeEncoder


def pool_of(**kwargs) -> EncoderPoolConfig:
    return EngineConfig.from_kwargs(**kwargs).encoder_pool


def test_serve_flags_reach_engine_args():
    ns = build_parser(with_bench=False).parse_args(
        [
            "serve",
            "--encoder-urls",
            "http://127.0.0.1:18201/",
            "http://127.0.0.1:18203",
            "--encoder-fallback",
            "fail",
            "--encoder-timeout",
            "2.5",
            "--encoder-secret-file",
            "/tmp/h16-client/secret",
        ]
    )
    args = serve_configs_of(ns)
    assert args.encoder_urls == ("http://127.0.0.1:18201", "http://127.0.0.1:18203")
    assert (args.resolved_encoder_fallback, args.resolved_encoder_timeout) == ("fail", 2.5)
    assert args.encoder_secret_file == "/tmp/h16-client/secret"
    plain = serve_configs_of(build_parser(with_bench=False).parse_args(["serve"]))
    assert plain.encoder_urls is None and plain.resolved_encoder_fallback == "local"
    assert plain.resolved_encoder_timeout == 30.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"encoder_fallback": "fail"}, "--encoder-fallback configure the remote encoder pool"),
        ({"encoder_secret": "x"}, "MMSERVE_ENCODER_SECRET configure"),
        ({"encoder_urls": ("localhost:1",)}, "give the http://host:port"),
        ({"encoder_urls": ("http://a:1/v1",)}, "without a path"),
        ({"encoder_urls": ("http://a:1", "http://a:1")}, "names an encoder twice"),
        ({"encoder_urls": ("http://a:1",), "encoder_fallback": "maybe"}, "--encoder-fallback"),
        ({"encoder_urls": ("http://a:1",), "encoder_timeout": 0}, "--encoder-timeout"),
        (
            {"encoder_urls": ("http://a:1",), "encoder_secret": "x", "encoder_secret_file": "f"},
            "given twice",
        ),
    ],
)
def test_encoder_flags_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        configs_of(**kwargs)


def test_the_secret_file_is_read_stripped_and_checked(tmp_path):
    path = tmp_path / "secret"
    path.write_text("  s3cret-value\n")
    urls = ("http://a:1",)
    assert read_encoder_secret(pool_of(encoder_urls=urls, encoder_secret_file=str(path))) == (
        b"s3cret-value"
    )
    assert read_encoder_secret(pool_of(encoder_urls=urls, encoder_secret="env")) == b"env"
    assert read_encoder_secret(pool_of(encoder_urls=urls)) is None
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_encoder_secret(pool_of(encoder_urls=urls, encoder_secret_file=str(path)))
    path.write_text("two words")
    with pytest.raises(ValueError, match="printable ASCII without spaces"):
        read_encoder_secret(pool_of(encoder_urls=urls, encoder_secret_file=str(path)))
    with pytest.raises(ValueError, match="cannot read it"):
        read_encoder_secret(
            pool_of(encoder_urls=urls, encoder_secret_file=str(tmp_path / "missing"))
        )


def test_the_engine_core_gets_a_pool_that_fits_its_model(qwen2_vl_dir):
    width = load_model_config(qwen2_vl_dir).mm_embedding_width  # the hidden size: no DeepStack
    fake = FakeEncoder(secret=b"k")
    fake.behaviour.fingerprint = model_fingerprint(qwen2_vl_dir)
    fake.behaviour.embedding_width = width
    try:
        args = EngineConfig.from_kwargs(
            model=str(qwen2_vl_dir),
            device="cpu",
            encoder_urls=(fake.url,),
            encoder_secret="k",
            kv_cache_memory_bytes=1 << 20,
        )
        core, _ = build_core(args, resolve_shape(args), EngineMetrics())
        source = core.executor.runner.encoder_source
        assert isinstance(source, RemoteEncoderPool)
        assert source.config.fallback == "local" and source.config.secret == b"k"
        core.shutdown()
        fake.behaviour.embedding_width = width + 1
        with pytest.raises(ValueError, match=f"encoder {fake.url} returns embedding rows"):
            build_core(args, resolve_shape(args), EngineMetrics())
    finally:
        fake.close()


def test_encoder_flags_reach_the_engine_process_intact():
    args = EngineConfig.from_kwargs(encoder_urls=("http://127.0.0.1:18201",), encoder_secret="k")
    again = msgspec.json.decode(msgspec.json.encode(args), type=EngineConfig).encoder_pool
    assert again.encoder_urls == args.encoder_pool.encoder_urls and again.encoder_secret == "k"
