"""Start-up discovery of the encoder pool: `GET /v1/encode/info` on every `--encoder-urls` entry.

A language-model server refuses to pair with an encoder whose embeddings would not fit its
model: another checkpoint (fingerprint), another hidden size, another dtype. An encoder that
does not answer within the discovery window stops the start-up with its URL in the error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from mmserve.config.pool import normalise_encoder_url


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What an encoder must match: the LM's checkpoint, hidden size and embedding dtype."""

    fingerprint: str
    hidden_size: int
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
    for key in ("zmq_port", "model_fingerprint", "hidden_size", "dtype"):
        if key not in info:
            raise ValueError(f"encoder {url}: /v1/encode/info lacks {key!r}")
    if info["model_fingerprint"] != expected.fingerprint:
        raise ValueError(
            f"encoder {url} serves another checkpoint: model fingerprint "
            f"{str(info['model_fingerprint'])[:16]}... differs from this server's "
            f"{expected.fingerprint[:16]}... (config.json, preprocessor_config.json and the "
            "weight files must be the same on both)"
        )
    if info["hidden_size"] != expected.hidden_size:
        raise ValueError(
            f"encoder {url} returns embeddings of hidden size {info['hidden_size']}, this "
            f"model needs {expected.hidden_size}"
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
