"""The API side's part for a disaggregated server (`--encoder-urls`): the planner, the secret.

The API side gets an `HttpUrlPlanner` for http(s) images; the engine core gets a
`RemoteEncoderPool` (`engine.core.encoder_pool`). Both read the same shared secret.
"""

from __future__ import annotations

from mmserve.config.pool import EncoderPoolConfig
from mmserve.disaggregation.planner import HttpUrlPlanner
from mmserve.disaggregation.protocol import read_secret_file


def read_encoder_secret(pool: EncoderPoolConfig) -> bytes | None:
    """The secret shared with the encoder pool: --encoder-secret-file's content (surrounding
    whitespace stripped), else MMSERVE_ENCODER_SECRET (put into args by the CLI), else None."""
    if pool.encoder_secret_file is None:
        return None if pool.encoder_secret is None else pool.encoder_secret.strip().encode()
    return read_secret_file(pool.encoder_secret_file)


def build_url_planner(pool: EncoderPoolConfig) -> HttpUrlPlanner:
    """The API side's planner of http(s) images: the pool fetches them, this server never."""
    assert pool.encoder_urls
    return HttpUrlPlanner(
        pool.encoder_urls, secret=read_encoder_secret(pool), timeout_s=pool.resolved_encoder_timeout
    )
