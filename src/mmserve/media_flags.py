"""The media, decode and encoder-pool flags: groups `serve` adds, and `encode` shares in part."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mmserve.engine.args import ENCODER_FALLBACKS

ENCODER_SECRET_ENV = "MMSERVE_ENCODER_SECRET"


def add_encoder_pool_args(a: Callable[..., Any]) -> None:
    """Encode/prefill disaggregation (docs/disaggregation.md): images go to `mmserve encode`."""
    a(
        "--encoder-urls",
        nargs="+",
        default=None,
        metavar="URL",
        help="http://host:port of `mmserve encode` servers: images are encoded there and their "
        "embeddings shipped here (videos stay local). Without it this server encodes locally.",
    )
    a(
        "--encoder-fallback",
        choices=ENCODER_FALLBACKS,
        default=None,
        help="When no encoder could encode an image: 'local' (default) encodes it here with "
        "this server's vision tower; 'fail' fails its request with a 503.",
    )
    a(
        "--encoder-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="How long one encoder may take for one image before it is taken out of rotation "
        "and the image tried on another (default 30).",
    )
    a(
        "--encoder-secret-file",
        default=None,
        metavar="PATH",
        help="File holding the secret shared with the encoders (signs every message, "
        f"authorizes their HTTP routes); also read from ${ENCODER_SECRET_ENV}.",
    )


def add_video_args(a: Callable[..., Any]) -> None:
    """Video ceilings (docs/video.md): checked from the container header, then while decoding;
    a request's mm_processor_kwargs may lower the sampling, never these."""
    a(
        "--max-video-bytes",
        type=int,
        default=64 << 20,
        metavar="BYTES",
        help="Largest video container to fetch, read or decode (data: URLs are also bound by "
        "--max-request-body-bytes). Default 64 MiB.",
    )
    a(
        "--max-video-seconds",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="Longest video, by its header and by the timestamps of its frames. Default 600.",
    )
    a(
        "--max-video-frames-decoded",
        type=int,
        default=36_000,
        metavar="N",
        help="Most frames the decoder may walk through in one video (every frame up to the "
        "last one sampled, not only the kept ones). Default 36000 (10 min at 60 fps).",
    )
    a(
        "--max-video-frame-pixels",
        type=int,
        default=4096 * 2160,
        metavar="PIXELS",
        help="Largest video frame (width x height), checked from the stream header before "
        "decoding. Default 4096x2160 = 8847360.",
    )
    a(
        "--max-video-decoded-pixels",
        type=int,
        default=8 << 30,
        metavar="PIXELS",
        help="Most pixels decoded from one video, all walked frames together (decoder work). "
        "Default 8 Gi (~4000 1080p frames).",
    )
    a(
        "--video-decode-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="How long a decode worker may take for a video's header, and then for its "
        "frames, before it is killed and the request fails. Default 30.",
    )


def add_decode_args(a: Callable[..., Any]) -> None:
    """Decode-memory caps: each is checked from the image header, before pixels are decoded."""
    a(
        "--max-image-pixels",
        type=int,
        default=None,
        metavar="PIXELS",
        help="Largest image (width x height) to decode; bigger ones get 400. Default: the image "
        "processor's max_pixels or 4096x4096 = 16777216, whichever is larger.",
    )
    a(
        "--max-decode-bytes-per-request",
        type=int,
        default=1 << 30,
        metavar="BYTES",
        help="Most estimated decode memory of one request's images together (1-bit and palette "
        "images count as decoded RGB); over it: 400. 0: only the in-flight cap. Default 1 GiB.",
    )
    a(
        "--max-inflight-decode-bytes",
        type=int,
        default=2 << 30,
        metavar="BYTES",
        help="Most estimated memory of decoded images alive in the server at once; a decode "
        "waits for room (first come, first served) up to --decode-wait-timeout, then 503. "
        "0: no cap. Default 2 GiB.",
    )
    a(
        "--decode-wait-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="How long a decode may wait for --max-inflight-decode-bytes room before a 503.",
    )
    a(
        "--decode-worker-max-rss-mb",
        type=int,
        default=1024,
        metavar="MB",
        help="A decode worker process resident over this after a decode is replaced. 0: never.",
    )


def add_media_flags(a: Callable[..., Any]) -> None:
    """Where media may come from (the URL policy) and how much of it is decoded: the flags
    `serve` and `encode` share (an encoder fetches and decodes the images it is sent)."""
    add_url_policy_args(a)
    add_decode_args(a)


def add_url_policy_args(a: Callable[..., Any]) -> None:
    """Which http(s) and file:// media may be read, and how much."""
    a(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="DOMAIN",
        help="Only fetch http(s) media from these hosts (space or comma separated): 'host' "
        "allows the scheme's default port (80/443), 'host:port' (IPv6: '[::1]:port') that "
        "port. Listed hosts may resolve to private addresses; unlisted ones never.",
    )
    a(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="Allow file:// media under this directory only; file:// is refused without it.",
    )
    a(
        "--max-concurrent-media-fetches",
        type=int,
        default=16,
        metavar="N",
        help="Most http(s) media fetches in flight; a fetch that finds no free slot within "
        "--media-fetch-timeout fails with 503. Inline (data:) images never wait for them.",
    )
    a(
        "--media-fetch-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="Timeout of one http(s) media fetch.",
    )
    a(
        "--max-media-bytes",
        type=int,
        default=20 * 1024 * 1024,
        help="Largest media item to fetch or decode, in bytes.",
    )
