"""`mmserve encode`'s configuration and its flags (generated from the fields; torch-free)."""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mmserve.config.device import DEVICE, device_flag
from mmserve.config.flags import add_flags, check_positive, flag, values_from
from mmserve.config.media import DECODE, URL_POLICY, MediaConfig
from mmserve.config.model import MODEL, dtype_flag
from mmserve.config.pool import ENCODER_SECRET_ENV
from mmserve.config.server import (
    FRONTEND,
    host_flag,
    log_level_flag,
    uvicorn_log_level_flag,
)
from mmserve.disaggregation.protocol import read_secret_file

# An encoder reads the images it is sent: it shares `serve`'s URL policy and decode caps.
ENCODE_MEDIA_TOPICS = (URL_POLICY, DECODE)
ENCODER = "Encoder"
SECRET_FLAG = "--encoder-secret-file"
DEFAULT_PATCH_BUDGET = 32768
_TITLES = {
    MODEL: "Model and device",
    DEVICE: "Model and device",
    FRONTEND: "Network",
    "Multimodal and media": "Media (fetched and decoded here)",
}


@dataclass(frozen=True)
class EncodeServerConfig:
    """What `mmserve encode` runs with. `secret` comes from `encoder_secret_file`, else from
    $MMSERVE_ENCODER_SECRET (`from_cli` reads both); `media` holds the shared media flags."""

    model: str = flag(
        required=True,
        group=MODEL,
        metavar="DIR",
        help="A Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint directory: only its vision tower "
        "(visual.*) is loaded, never the language model. Language-model servers pair with "
        "this encoder only when they serve the same checkpoint (same configs and weight files).",
    )
    dtype: str = dtype_flag()
    device: str = device_flag()
    encoder_cache_gb: float = flag(
        4.0,
        type=float,
        group=ENCODER,
        metavar="GIB",
        help="GiB of embeddings kept by content (an LRU shared by every client): an image "
        "sent again, by any language-model server, is answered without encoding. 0: no "
        "cache. Default {default}.",
    )
    encoder_patch_budget: int | None = flag(
        None,
        type=int,
        group=ENCODER,
        metavar="PATCHES",
        help="Most input patches (grid_t x grid_h x grid_w, all items together) in one call "
        f"of the vision tower: what its activation memory scales with. Default "
        f"{DEFAULT_PATCH_BUDGET}, floored at the largest image the checkpoint's processor "
        "produces; a larger item runs alone.",
    )
    host: str = host_flag(
        "Address of the HTTP server and the ZMQ socket. A non-loopback address needs "
        f"{SECRET_FLAG} (or ${ENCODER_SECRET_ENV}). Default {{default}}."
    )
    port: int = flag(8100, type=int, group=FRONTEND, help="HTTP port. Default {default}.")
    zmq_port: int | None = flag(
        None,
        type=int,
        group=FRONTEND,
        metavar="PORT",
        help="Port of the ZMQ ROUTER socket that receives items. Default --port + 1.",
    )
    encoder_secret_file: str | None = flag(
        None,
        group=FRONTEND,
        metavar="PATH",
        help="File holding the secret shared with the language-model servers: every ZMQ "
        "message carries an HMAC under it (others are dropped) and the HTTP /v1/encode/* "
        f"routes need 'Authorization: Bearer <secret>'. Also read from ${ENCODER_SECRET_ENV}.",
    )
    log_level: str = log_level_flag()
    uvicorn_log_level: str = uvicorn_log_level_flag()
    media: MediaConfig = field(default_factory=MediaConfig)
    secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model}: no config.json there; is it a model dir?")
        if self.zmq_port is None:
            object.__setattr__(self, "zmq_port", self.port + 1)
        for flag_name, port in (("--port", self.port), ("--zmq-port", self.zmq_port)):
            if not 0 < port < 65536:
                raise ValueError(f"{flag_name} must be a TCP port (1-65535), got {port}")
        if self.port == self.zmq_port:
            raise ValueError(f"--zmq-port must differ from --port ({self.port})")
        if self.encoder_cache_gb < 0:
            raise ValueError("--encoder-cache-gb must be >= 0 (0: no cache)")
        check_positive("encoder_patch_budget", self.encoder_patch_budget, optional=True)
        if self.secret is None and not is_loopback(self.host):
            raise ValueError(
                f"--host {self.host} is not a loopback address: anyone who reaches it could "
                f"use this encoder (and its URL fetches); give {SECRET_FLAG} (or set "
                f"${ENCODER_SECRET_ENV}) to bind it"
            )

    @property
    def cache_bytes(self) -> int:
        return int(self.encoder_cache_gb * (1 << 30))

    @classmethod
    def from_cli(cls, ns: argparse.Namespace, environ: Mapping[str, str]) -> EncodeServerConfig:
        """Raises ValueError naming the flag at fault."""
        media = MediaConfig(**values_from(ns, MediaConfig))
        values = values_from(ns, cls)
        return cls(**values, media=media, secret=read_secret(ns.encoder_secret_file, environ))


def add_encode_args(p: argparse.ArgumentParser) -> None:
    add_flags(
        p,
        [EncodeServerConfig],
        groups=(MODEL, DEVICE, ENCODER, FRONTEND),
        group_titles=_TITLES,
    )
    add_flags(
        p,
        [MediaConfig],
        groups=("Multimodal and media",),
        topics=ENCODE_MEDIA_TOPICS,
        group_titles=_TITLES,
    )


def read_secret(path: str | None, environ: Mapping[str, str]) -> bytes | None:
    """The shared secret from the file (surrounding whitespace dropped), else the environment."""
    if path is not None:
        return read_secret_file(path, SECRET_FLAG)
    value = environ.get(ENCODER_SECRET_ENV, "").strip()
    return value.encode() if value else None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere
