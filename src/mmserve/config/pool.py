"""Encoder pool configuration (disaggregation, docs/disaggregation.md): where images encode."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from mmserve.config.flags import check_choice, check_seconds, flag

ENCODER_SECRET_ENV = "MMSERVE_ENCODER_SECRET"
ENCODER_FALLBACKS = ("local", "fail")
POOL = "Encoder pool (disaggregation)"
DEFAULT_ENCODER_FALLBACK = "local"
DEFAULT_ENCODER_TIMEOUT_S = 30.0


def normalise_encoder_url(url: str) -> str:
    """`http://host:port` without a trailing slash; ValueError naming the URL otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(
            f"--encoder-urls {url!r}: give the http://host:port of an `mmserve encode` server"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"--encoder-urls {url!r}: give only http://host:port, without a path")
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(frozen=True)
class EncoderPoolConfig:
    """`mmserve encode` servers that encode this server's images. The other fields need
    `encoder_urls`: None there means not given (see `resolved_*`). The secret comes from
    `encoder_secret_file`, or `encoder_secret` (the CLI fills it from $MMSERVE_ENCODER_SECRET)."""

    encoder_urls: tuple[str, ...] | None = flag(
        None,
        nargs="+",
        group=POOL,
        metavar="URL",
        help="http://host:port of `mmserve encode` servers: images are encoded there and their "
        "embeddings shipped here (videos stay local). Without it this server encodes locally.",
    )
    encoder_fallback: str | None = flag(
        None,
        choices=ENCODER_FALLBACKS,
        group=POOL,
        help=f"When no encoder could encode an image: 'local' (default: "
        f"{DEFAULT_ENCODER_FALLBACK}) encodes it here with this server's vision tower; 'fail' "
        "fails its request with a 503.",
    )
    encoder_timeout: float | None = flag(
        None,
        type=float,
        group=POOL,
        metavar="SECONDS",
        help="How long one encoder may take for one image before it is taken out of rotation "
        f"and the image tried on another (default {DEFAULT_ENCODER_TIMEOUT_S:g}).",
    )
    encoder_secret_file: str | None = flag(
        None,
        group=POOL,
        metavar="PATH",
        help="File holding the secret shared with the encoders (signs every message, "
        f"authorizes their HTTP routes); also read from ${ENCODER_SECRET_ENV}.",
    )
    # From the environment (no flag): a secret never goes on a command line.
    encoder_secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.encoder_urls is None:
            given = [
                "--" + name.replace("_", "-")
                for name in ("encoder_fallback", "encoder_timeout", "encoder_secret_file")
                if getattr(self, name) is not None
            ]
            if self.encoder_secret is not None:
                given.append(ENCODER_SECRET_ENV)
            if given:
                raise ValueError(
                    f"{', '.join(given)} configure the remote encoder pool; give "
                    "--encoder-urls too, or leave them out"
                )
            return
        urls = (self.encoder_urls,) if isinstance(self.encoder_urls, str) else self.encoder_urls
        urls = tuple(normalise_encoder_url(u) for u in urls)
        if not urls:
            raise ValueError("--encoder-urls needs at least one http://host:port")
        if len(set(urls)) != len(urls):
            raise ValueError(f"--encoder-urls names an encoder twice: {list(urls)}")
        object.__setattr__(self, "encoder_urls", urls)
        if self.encoder_fallback is not None:
            check_choice("encoder_fallback", self.encoder_fallback, ENCODER_FALLBACKS)
        if self.encoder_timeout is not None:
            check_seconds("encoder_timeout", self.encoder_timeout)
        if self.encoder_secret_file is not None and self.encoder_secret is not None:
            raise ValueError(
                "the encoder secret is given twice (--encoder-secret-file and "
                f"{ENCODER_SECRET_ENV}); give one"
            )
        if self.encoder_secret is not None and not self.encoder_secret.strip():
            raise ValueError(f"{ENCODER_SECRET_ENV} is empty; unset it or give a secret")

    @property
    def resolved_encoder_fallback(self) -> str:
        return self.encoder_fallback or DEFAULT_ENCODER_FALLBACK

    @property
    def resolved_encoder_timeout(self) -> float:
        return self.encoder_timeout or DEFAULT_ENCODER_TIMEOUT_S
