"""The media flags as a MediaConfig: what `serve` (API side and local fallback) and `encode`
fetch and decode under."""

from __future__ import annotations

from mmserve.engine.args import EngineArgs
from mmserve.processing.image_decode import default_max_image_pixels
from mmserve.processing.image_processor import ImageProcessorConfig
from mmserve.processing.media import MediaConfig


def media_config_from_args(
    args: EngineArgs, image_config: ImageProcessorConfig, *, decode_workers: int
) -> MediaConfig:
    """The URL policy and decode limits of the media flags (`serve` and `encode` share them)."""
    # No image needs more pixels than the processor resizes it to (or 4096x4096 when that is less).
    max_image_pixels = args.max_image_pixels or default_max_image_pixels(image_config.max_pixels)
    return MediaConfig(
        allowed_media_domains=args.allowed_media_domains or (),
        allowed_local_media_path=args.allowed_local_media_path,
        fetch_timeout_s=args.media_fetch_timeout,
        max_fetch_bytes=args.max_media_bytes,
        max_concurrent_fetches=args.max_concurrent_media_fetches,
        decode_workers=decode_workers,
        max_image_pixels=max_image_pixels,
        max_decode_bytes_per_request=args.max_decode_bytes_per_request,
        max_inflight_decode_bytes=args.max_inflight_decode_bytes,
        decode_wait_timeout_s=args.decode_wait_timeout,
        decode_worker_max_rss_bytes=args.decode_worker_max_rss_mb << 20,
        max_video_bytes=args.max_video_bytes,
        max_video_seconds=args.max_video_seconds,
        max_video_frames_decoded=args.max_video_frames_decoded,
        max_video_frame_pixels=args.max_video_frame_pixels,
        max_video_decoded_pixels=args.max_video_decoded_pixels,
        video_decode_timeout_s=args.video_decode_timeout,
    )
