"""Media configuration: where media may come from and how much is decoded (the only home of
the URL policy, decode caps and video ceilings, and of their defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from mmserve.config.allowlist import AllowedHost, parse_allowlist
from mmserve.config.flags import check_positive, flag

MEDIA = "Multimodal and media"
# Topics: what `encode` shares of these flags (an encoder fetches and decodes images only).
URL_POLICY = "url"
DECODE = "decode"
VIDEO = "video"
# No image needs more pixels than the processor resizes it to, or 4096x4096 when that is less.
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
# Decode worker processes of a server (`serve`'s API process, `encode`): a decoder crash or
# hang then fails one request instead of the server.
SERVER_DECODE_WORKERS = 2
# A request's video fps ceiling: a common camera rate. The frames a request keeps stay bounded
# by the video processor's max_frames whatever the rate; this bounds how short a clip may be
# to reach that many (docs/video.md).
DEFAULT_MAX_VIDEO_FPS = 30.0


def split_domains(values: list[str] | tuple[str, ...] | str | None) -> tuple[str, ...] | None:
    """`--allowed-media-domains a.com b.com` and `--allowed-media-domains a.com,b.com` agree."""
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    out = [part.strip().lower() for v in values for part in v.replace(",", " ").split()]
    return tuple(p for p in out if p)


@dataclass(frozen=True)
class VideoLimits:
    """Engine ceilings on one video (MediaConfig's video fields); a request lowers none."""

    max_video_bytes: int
    max_video_seconds: float
    max_video_frames_decoded: int
    max_video_frame_pixels: int
    max_video_decoded_pixels: int

    def __post_init__(self) -> None:
        for name in (
            "max_video_bytes",
            "max_video_frames_decoded",
            "max_video_frame_pixels",
            "max_video_decoded_pixels",
        ):
            check_positive(name, getattr(self, name))
        if not (math.isfinite(self.max_video_seconds) and self.max_video_seconds > 0):
            raise ValueError(f"--max-video-seconds must be positive, got {self.max_video_seconds}")


@dataclass(frozen=True)
class MediaConfig:
    """Where media may come from and how much of it we accept.

    `allowed_media_domains` empty means any public host; listed `host` or `host:port` entries
    are the only ones fetched (a bare host on its scheme's default port only), and may resolve
    to private addresses. `max_concurrent_media_fetches` bounds the server's http(s) fetches in
    flight. `decode_workers` 0 decodes in-process (tests, the offline API); > 0 decodes in that
    many worker processes started on first use (the factory sets it, no flag).

    Decode memory is estimated from each image's header (`ImageHeader.decode_bytes`) before
    any pixel exists: `max_decode_bytes_per_request` caps the sum over one request's images
    (400), `max_inflight_decode_bytes` the sum over decoded images alive in the server (a
    decode waits up to `decode_wait_timeout` s for room, then 503); 0 means no cap. A decode
    worker resident over `decode_worker_max_rss_mb` (0: no limit) after a decode is retired.
    """

    allowed_media_domains: tuple[str, ...] | None = flag(
        None,
        nargs="+",
        group=MEDIA,
        topic=URL_POLICY,
        metavar="DOMAIN",
        help="Only fetch http(s) media from these hosts (space or comma separated): 'host' "
        "allows the scheme's default port (80/443), 'host:port' (IPv6: '[::1]:port') that "
        "port. Listed hosts may resolve to private addresses; unlisted ones never.",
    )
    allowed_local_media_path: str | None = flag(
        None,
        group=MEDIA,
        topic=URL_POLICY,
        metavar="DIR",
        help="Allow file:// media under this directory only; file:// is refused without it.",
    )
    max_concurrent_media_fetches: int = flag(
        16,
        type=int,
        group=MEDIA,
        topic=URL_POLICY,
        metavar="N",
        help="Most http(s) media fetches in flight; a fetch that finds no free slot within "
        "--media-fetch-timeout fails with 503. Inline (data:) images never wait for them. "
        "Default {default}.",
    )
    media_fetch_timeout: float = flag(
        5.0,
        type=float,
        group=MEDIA,
        topic=URL_POLICY,
        metavar="SECONDS",
        help="Timeout of one http(s) media fetch. Default {default}.",
    )
    max_media_bytes: int = flag(
        20 << 20,
        type=int,
        group=MEDIA,
        topic=URL_POLICY,
        unit="bytes",
        help="Largest media item to fetch or decode, in bytes. Default {default}.",
    )
    # Decode memory (issue #20): caps checked from image headers, before any pixel exists.
    max_image_pixels: int | None = flag(
        None,
        type=int,
        group=MEDIA,
        topic=DECODE,
        metavar="PIXELS",
        help="Largest image (width x height) to decode; bigger ones get 400. Default: the image "
        f"processor's max_pixels or 4096x4096 = {DEFAULT_MAX_IMAGE_PIXELS}, whichever is larger.",
    )
    max_decode_bytes_per_request: int = flag(
        1 << 30,
        type=int,
        group=MEDIA,
        topic=DECODE,
        metavar="BYTES",
        unit="bytes",
        help="Most estimated decode memory of one request's images together (1-bit and palette "
        "images count as decoded RGB); over it: 400. 0: only the in-flight cap. "
        "Default {default}.",
    )
    max_inflight_decode_bytes: int = flag(
        2 << 30,
        type=int,
        group=MEDIA,
        topic=DECODE,
        metavar="BYTES",
        unit="bytes",
        help="Most estimated memory of decoded images alive in the server at once; a decode "
        "waits for room (first come, first served) up to --decode-wait-timeout, then 503. "
        "0: no cap. Default {default}.",
    )
    decode_wait_timeout: float = flag(
        10.0,
        type=float,
        group=MEDIA,
        topic=DECODE,
        metavar="SECONDS",
        help="How long a decode may wait for --max-inflight-decode-bytes room before a 503. "
        "Default {default}.",
    )
    decode_worker_max_rss_mb: int = flag(
        1024,
        type=int,
        group=MEDIA,
        topic=DECODE,
        metavar="MB",
        help="A decode worker process resident over this after a decode is replaced. 0: never. "
        "Default {default}.",
    )
    # Video ceilings (issue #17, docs/video.md): engine-wide, a request can lower none of them.
    max_video_bytes: int = flag(
        64 << 20,
        type=int,
        group=MEDIA,
        topic=VIDEO,
        metavar="BYTES",
        unit="bytes",
        help="Largest video container to fetch, read or decode (data: URLs are also bound by "
        "--max-request-body-bytes). Default {default}.",
    )
    max_video_seconds: float = flag(
        600.0,
        type=float,
        group=MEDIA,
        topic=VIDEO,
        metavar="SECONDS",
        help="Longest video, by its header and by the timestamps of its frames. Default {default}.",
    )
    max_video_frames_decoded: int = flag(
        36_000,
        type=int,
        group=MEDIA,
        topic=VIDEO,
        metavar="N",
        help="Most frames the decoder may walk through in one video (every frame up to the "
        "last one sampled, not only the kept ones). Default {default} (10 min at 60 fps).",
    )
    max_video_frame_pixels: int = flag(
        4096 * 2160,
        type=int,
        group=MEDIA,
        topic=VIDEO,
        metavar="PIXELS",
        help="Largest video frame (width x height), checked from the stream header before "
        "decoding. Default {default} (4096x2160).",
    )
    max_video_decoded_pixels: int = flag(
        8 << 30,
        type=int,
        group=MEDIA,
        topic=VIDEO,
        metavar="PIXELS",
        unit="count",
        help="Most pixels decoded from one video, all walked frames together (decoder work). "
        "Default {default} (~4000 1080p frames).",
    )
    max_video_fps: float = flag(
        DEFAULT_MAX_VIDEO_FPS,
        type=float,
        group=MEDIA,
        topic=VIDEO,
        metavar="FPS",
        help="Highest video sampling rate a request may ask for (mm_processor_kwargs or "
        "media_io_kwargs.video fps); over it: 400. The frames kept stay capped by the video "
        "processor's max_frames. Default {default}.",
    )
    video_decode_timeout: float = flag(
        30.0,
        type=float,
        group=MEDIA,
        topic=VIDEO,
        metavar="SECONDS",
        help="How long a decode worker may take for a video's header, and then for its "
        "frames, before it is killed and the request fails. Default {default}.",
    )
    # Set by whoever runs the loader (no flag): see the class docstring.
    decode_workers: int = 0
    decode_timeout_s: float = 10.0
    max_redirects: int = 3

    def __post_init__(self) -> None:
        domains = split_domains(self.allowed_media_domains) or ()
        # ValueError names a bad entry; entries are kept in their canonical spelling.
        allowlist = parse_allowlist(domains)
        object.__setattr__(self, "allowed_media_domains", tuple(str(e) for e in allowlist))
        for name in ("max_concurrent_media_fetches", "max_media_bytes", "decode_timeout_s"):
            check_positive(name, getattr(self, name))
        if not self.media_fetch_timeout > 0:
            raise ValueError(f"--media-fetch-timeout must be > 0 s, got {self.media_fetch_timeout}")
        check_positive("max_image_pixels", self.max_image_pixels, optional=True)
        if self.max_redirects < 0 or self.decode_workers < 0:
            raise ValueError("max_redirects and decode_workers must be >= 0")
        self._check_decode_fields()
        check_positive("video_decode_timeout", self.video_decode_timeout)
        if not (math.isfinite(self.max_video_fps) and self.max_video_fps > 0):
            raise ValueError(f"--max-video-fps must be a positive number, got {self.max_video_fps}")
        self.video_limits  # noqa: B018 - VideoLimits checks the video ceilings
        if self.allowed_local_media_path is not None:
            root = Path(self.allowed_local_media_path)
            if not root.is_absolute():
                raise ValueError(
                    "--allowed-local-media-path must be an absolute path, got "
                    f"{self.allowed_local_media_path!r}"
                )

    def _check_decode_fields(self) -> None:
        for name in (
            "max_decode_bytes_per_request",
            "max_inflight_decode_bytes",
            "decode_worker_max_rss_mb",
        ):
            if getattr(self, name) < 0:
                flag_name = "--" + name.replace("_", "-")
                raise ValueError(f"{flag_name} must be >= 0 (0: no cap), got {getattr(self, name)}")
        check_positive("decode_wait_timeout", self.decode_wait_timeout)
        per_request, inflight = self.max_decode_bytes_per_request, self.max_inflight_decode_bytes
        if inflight and per_request > inflight:
            # A request holds all its decoded images at once, so one over the server-wide cap
            # would wait for room that can never appear.
            raise ValueError(
                f"--max-decode-bytes-per-request ({per_request}) must not exceed "
                f"--max-inflight-decode-bytes ({inflight}); lower it or raise the in-flight cap"
            )

    @property
    def allowlist(self) -> tuple[AllowedHost, ...]:
        return parse_allowlist(self.allowed_media_domains or ())

    @property
    def image_pixel_cap(self) -> int:
        """--max-image-pixels, or the default when no processor has resolved it."""
        return self.max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS

    @property
    def video_limits(self) -> VideoLimits:
        return VideoLimits(
            max_video_bytes=self.max_video_bytes,
            max_video_seconds=self.max_video_seconds,
            max_video_frames_decoded=self.max_video_frames_decoded,
            max_video_frame_pixels=self.max_video_frame_pixels,
            max_video_decoded_pixels=self.max_video_decoded_pixels,
        )

    @property
    def decode_bytes_per_request_cap(self) -> int:
        """The per-request cap in force: a request can never use more than the in-flight cap."""
        return self.max_decode_bytes_per_request or self.max_inflight_decode_bytes

    def for_loader(self, *, processor_max_pixels: int, decode_workers: int) -> MediaConfig:
        """This config as a loader runs it: the pixel cap resolved against the image processor
        (no image needs more than it resizes to), decoding in `decode_workers` processes."""
        max_pixels = self.max_image_pixels or max(processor_max_pixels, DEFAULT_MAX_IMAGE_PIXELS)
        return replace(self, max_image_pixels=max_pixels, decode_workers=decode_workers)
