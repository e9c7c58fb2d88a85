"""`mmserve encode`'s flags and the validated configuration they become (torch-free)."""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mmserve.disaggregation.protocol import read_secret_file
from mmserve.engine.args import DEVICES, DTYPES, LOG_LEVELS, EngineArgs
from mmserve.media_flags import ENCODER_SECRET_ENV, add_media_flags

DEFAULT_PORT = 8100
DEFAULT_CACHE_GB = 4.0
SECRET_FLAG = "--encoder-secret-file"


def add_encode_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("Model and device").add_argument
    a(
        "--model",
        required=True,
        metavar="DIR",
        help="A Qwen2-VL / Qwen2.5-VL checkpoint directory: only its vision tower (visual.*) is "
        "loaded, never the language model. Language-model servers pair with this encoder only "
        "when they serve the same checkpoint (same configs and weight files).",
    )
    a("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on GPU, float32 on CPU.")
    a("--device", choices=DEVICES, default="auto", help="Where to run; auto: cuda if present.")
    a = p.add_argument_group("Encoder").add_argument
    a(
        "--encoder-cache-gb",
        type=float,
        default=DEFAULT_CACHE_GB,
        metavar="GIB",
        help="GiB of embeddings kept by content (an LRU shared by every client): an image "
        "sent again, by any language-model server, is answered without encoding. 0: no "
        f"cache. Default {DEFAULT_CACHE_GB:g}.",
    )
    a(
        "--encoder-patch-budget",
        type=int,
        default=None,
        metavar="PATCHES",
        help="Most input patches (grid_t x grid_h x grid_w, all items together) in one call "
        "of the vision tower: what its activation memory scales with. Default 32768, floored "
        "at the largest image the checkpoint's processor produces; a larger item runs alone.",
    )
    a = p.add_argument_group("Network").add_argument
    a(
        "--host",
        default="127.0.0.1",
        help="Address of the HTTP server and the ZMQ socket. A non-loopback address needs "
        f"{SECRET_FLAG} (or ${ENCODER_SECRET_ENV}). Default 127.0.0.1.",
    )
    a("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port. Default {DEFAULT_PORT}.")
    a(
        "--zmq-port",
        type=int,
        default=None,
        metavar="PORT",
        help="Port of the ZMQ ROUTER socket that receives items. Default --port + 1.",
    )
    a(
        SECRET_FLAG,
        default=None,
        metavar="PATH",
        help="File holding the secret shared with the language-model servers: every ZMQ "
        "message carries an HMAC under it (others are dropped) and the HTTP /v1/encode/* "
        f"routes need 'Authorization: Bearer <secret>'. Also read from ${ENCODER_SECRET_ENV}.",
    )
    a("--log-level", choices=LOG_LEVELS, default="info", help="mmserve's log level.")
    a(
        "--uvicorn-log-level",
        choices=LOG_LEVELS,
        default="warning",
        help="uvicorn's log level (access logs appear at info).",
    )
    add_media_flags(p.add_argument_group("Media (fetched and decoded here)").add_argument)


@dataclass(frozen=True)
class EncodeServerConfig:
    """What `mmserve encode` runs with; the media flags stay in `media_args` (the same
    EngineArgs fields `serve` validates and turns into a MediaConfig)."""

    media_args: EngineArgs  # model, dtype, device, host, port and the media flags
    zmq_port: int
    cache_bytes: int
    patch_budget: int | None
    secret: bytes | None
    log_level: str
    uvicorn_log_level: str

    def __post_init__(self) -> None:
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ValueError(f"--model {self.model_dir}: no config.json there; is it a model dir?")
        for flag, port in (("--port", self.port), ("--zmq-port", self.zmq_port)):
            if not 0 < port < 65536:
                raise ValueError(f"{flag} must be a TCP port (1-65535), got {port}")
        if self.port == self.zmq_port:
            raise ValueError(f"--zmq-port must differ from --port ({self.port})")
        if self.cache_bytes < 0:
            raise ValueError("--encoder-cache-gb must be >= 0 (0: no cache)")
        if self.patch_budget is not None and self.patch_budget <= 0:
            raise ValueError(f"--encoder-patch-budget must be positive, got {self.patch_budget}")
        if self.secret is None and not is_loopback(self.host):
            raise ValueError(
                f"--host {self.host} is not a loopback address: anyone who reaches it could "
                f"use this encoder (and its URL fetches); give {SECRET_FLAG} (or set "
                f"${ENCODER_SECRET_ENV}) to bind it"
            )

    @property
    def model_dir(self) -> str:
        return self.media_args.model

    @property
    def host(self) -> str:
        return self.media_args.host

    @property
    def port(self) -> int:
        return self.media_args.port

    @classmethod
    def from_cli(cls, ns: argparse.Namespace, environ: Mapping[str, str]) -> EncodeServerConfig:
        """Raises ValueError naming the flag at fault."""
        # Only the flags that mean the same as in `serve` go through EngineArgs (and its
        # checks); the encoder's own (--encoder-secret-file, ...) would mean the pool's there.
        shared = {*_media_flag_names(), *_SHARED_WITH_SERVE}
        media_args = EngineArgs.from_cli(argparse.Namespace(**{k: getattr(ns, k) for k in shared}))
        return cls(
            media_args=media_args,
            zmq_port=ns.zmq_port if ns.zmq_port is not None else ns.port + 1,
            cache_bytes=int(ns.encoder_cache_gb * (1 << 30)),
            patch_budget=ns.encoder_patch_budget,
            secret=read_secret(ns.encoder_secret_file, environ),
            log_level=ns.log_level,
            uvicorn_log_level=ns.uvicorn_log_level,
        )


_SHARED_WITH_SERVE = ("model", "host", "port", "dtype", "device", "log_level")


def _media_flag_names() -> list[str]:
    """The destinations of `add_media_flags`, as the parser names them."""
    parser = argparse.ArgumentParser(add_help=False)
    add_media_flags(parser.add_argument)
    return list(vars(parser.parse_args([])))


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
