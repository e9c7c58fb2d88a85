"""Start-up discovery of the encoder pool: `GET /v1/encode/info` on every `--encoder-urls` entry.

A language-model server refuses to pair with an encoder whose embeddings would not fit its
model: another handshake version, another checkpoint (fingerprint), another row width (hidden
size x (1 + DeepStack levels)), another dtype. An encoder that does not answer within the
discovery window stops the start-up with its URL in the error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from mmserve.config.pool import normalise_encoder_url
from mmserve.disaggregation.protocol import ENCODER_PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What an encoder must match: the LM's checkpoint, the width of its encoder output rows
    (`ModelConfig.mm_embedding_width`: hidden size x (1 + DeepStack levels)) and their dtype."""

    fingerprint: str
    embedding_width: int
    dtype: str  # "float32" | "bfloat16" | "float16"


@dataclass(frozen=True, slots=True)
class EncoderEndpoint:
    """One discovered encoder: its HTTP base URL (its name in metrics) and its ZMQ address."""

    url: str
    zmq_address: str


def auth_headers(secret: bytes | None) -> dict[str, str]:
    """The Authorization header an encoder with a shared secret requires on its HTTP routes."""
    return {} if secret is None else {"Authorization": f"Bearer {secret.decode()}"}


def discover(
    url: str,
    expected: ModelIdentity,
    *,
    secret: bytes | None,
    timeout_s: float,
    retry_interval_s: float = 0.25,
) -> EncoderEndpoint:
    """Ask `url` what it serves, retrying until `timeout_s`; ValueError on a mismatch or when
    it never answers (the error names the URL and what differed)."""
    url = normalise_encoder_url(url)
    deadline = time.monotonic() + timeout_s
    last_error = "no answer"
    with httpx.Client(timeout=min(5.0, timeout_s), trust_env=False) as client:
        while True:
            try:
                resp = client.get(f"{url}/v1/encode/info", headers=auth_headers(secret))
            except httpx.HTTPError as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code in (401, 403):
                    raise ValueError(
                        f"encoder {url} refused /v1/encode/info (HTTP {resp.status_code}): "
                        "the encoder secret differs (--encoder-secret-file or "
                        "MMSERVE_ENCODER_SECRET must be the encoder's)"
                    )
                if resp.status_code == 200:
                    return _check_info(url, _json(url, resp), expected)
                last_error = f"HTTP {resp.status_code}"
            if time.monotonic() + retry_interval_s > deadline:
                raise ValueError(
                    f"encoder {url} did not answer GET /v1/encode/info within {timeout_s:g} s "
                    f"({last_error}); is `mmserve encode` running there?"
                )
            time.sleep(retry_interval_s)


def _json(url: str, resp: httpx.Response) -> dict:
    try:
        body = resp.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise ValueError(f"encoder {url}: /v1/encode/info did not answer a JSON object")
    return body


def _check_info(url: str, info: dict, expected: ModelIdentity) -> EncoderEndpoint:
    version = info.get("protocol_version", 1)  # version 1 did not name itself
    if version != ENCODER_PROTOCOL_VERSION:
        raise ValueError(
            f"encoder {url} speaks encoder protocol {version!r}, this server speaks "
            f"{ENCODER_PROTOCOL_VERSION}; run the same mmserve version on both"
        )
    for key in ("zmq_port", "model_fingerprint", "embedding_width", "dtype"):
        if key not in info:
            raise ValueError(f"encoder {url}: /v1/encode/info lacks {key!r}")
    if info["model_fingerprint"] != expected.fingerprint:
        raise ValueError(
            f"encoder {url} serves another checkpoint: model fingerprint "
            f"{str(info['model_fingerprint'])[:16]}... differs from this server's "
            f"{expected.fingerprint[:16]}... (config.json, preprocessor_config.json and the "
            "weight files must be the same on both)"
        )
    if info["embedding_width"] != expected.embedding_width:
        raise ValueError(
            f"encoder {url} returns embedding rows of width {info['embedding_width']!r}, this "
            f"model needs {expected.embedding_width} (hidden size x (1 + DeepStack levels))"
        )
    if info["dtype"] != expected.dtype:
        raise ValueError(
            f"encoder {url} encodes in {info['dtype']}, this server runs {expected.dtype}; "
            "start both with the same --dtype"
        )
    port = info["zmq_port"]
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port <= 65535:
        raise ValueError(f"encoder {url}: /v1/encode/info gives zmq_port {port!r}")
    host = urlsplit(url).hostname
    assert host is not None
    host = f"[{host}]" if ":" in host else host
    return EncoderEndpoint(url=url, zmq_address=f"tcp://{host}:{port}")
