"""Video decoding with PyAV under engine ceilings, checked from the header, then while walking.

    header (before any frame):  container format (by magic bytes; only mp4/mov, webm/mkv,
                                avi), one video stream, frame W x H <= max_video_frame_pixels,
                                duration <= max_video_seconds,
                                frames <= max_video_frames_decoded,
                                frames x W x H <= max_video_decoded_pixels;
                                then `admit` (decode memory)
    while walking (each frame):  the same four again, on what the decoder actually produces
                                (a container can lie: huge pts gaps, more frames, a new size)

Only the sampled frames are kept, each resized to the plan's size as it is decoded, so memory
is one full frame plus the kept frames. Worker processes run `serve_video` (decode_workers.py).
"""

from __future__ import annotations

import dataclasses
import io
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from mmserve.config.media import VideoLimits
from mmserve.errors import VideoDecodeError, VideoTooLargeError
from mmserve.processing.decode_budget import Release, hold_until_collected
from mmserve.processing.image_processor import ImageProcessorConfig
from mmserve.processing.video_processor import VideoMeta, VideoPlan, plan_video
from mmserve.processing.video_resize import resize_frames
from mmserve.processing.video_sampling import VideoConfig

# Demuxers we open, chosen by magic bytes: never by FFmpeg's probe, which would also open
# playlists (hls, concat) that name other files and URLs.
_MATROSKA_MAGIC = b"\x1a\x45\xdf\xa3"
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip")
ALLOWED_VIDEO_FORMATS = ("mp4/mov", "webm/mkv", "avi")
# Peak bytes per pixel of one full frame in flight: the decoder's frame and its RGB copy, and
# the resize's int32 row buffers (three channels, source and accumulator).
_FRAME_WORK_BYTES_PER_PIXEL = 40
_DECODER_STATE_BYTES = 16 << 20


@dataclass(frozen=True)
class DecodedVideo:
    """A video's kept frames (already at the plan's size) and what identity needs of it."""

    frames: np.ndarray  # [num_frames, h, w, 3] uint8
    meta: VideoMeta
    content: bytes | memoryview  # the container's bytes, or the given frames' raw bytes


@dataclass(frozen=True)
class VideoHeader:
    meta: VideoMeta
    duration_s: float

    def decode_bytes(self, plan: VideoPlan) -> int:
        """Estimated peak memory of this decode: one full frame in flight, the kept frames."""
        h, w = plan.resized_hw
        full = self.meta.width * self.meta.height * _FRAME_WORK_BYTES_PER_PIXEL
        return full + plan.num_frames * h * w * 3 + _DECODER_STATE_BYTES


VideoAdmit = Callable[[VideoHeader, VideoPlan], Release | None]


def container_format(data: bytes) -> str:
    """The FFmpeg demuxer for these bytes, from their magic; a clear error for anything else."""
    if data[:4] == _MATROSKA_MAGIC:
        return "matroska"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    if len(data) >= 8 and data[4:8] in _MP4_BOXES:
        return "mov"
    raise VideoDecodeError(
        f"the data is not a supported video container; send one of "
        f"{', '.join(ALLOWED_VIDEO_FORMATS)}",
        param="video_url",
    )


def _too_large(what: str, value: float, limit: float, flag: str) -> VideoTooLargeError:
    shown = f"{value:.1f}" if isinstance(value, float) else str(value)
    return VideoTooLargeError(
        f"the video's {what} is {shown}, over this server's limit of {limit:g} ({flag}); "
        "send a shorter or smaller video",
        param="video_url",
    )


def _read_header(container, limits: VideoLimits) -> VideoHeader:  # av.container.InputContainer
    streams = container.streams.video
    if not streams:
        raise VideoDecodeError(
            "the container has no video stream: it is truncated, or holds no video",
            param="video_url",
        )
    stream = streams[0]
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    if width <= 0 or height <= 0:
        raise VideoDecodeError("the video stream has no frame size", param="video_url")
    if width * height > limits.max_video_frame_pixels:
        raise _too_large(
            f"frame size in pixels ({width}x{height})",
            width * height,
            limits.max_video_frame_pixels,
            "--max-video-frame-pixels",
        )
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    if not (math.isfinite(fps) and fps > 0):
        raise VideoDecodeError("the video stream has no frame rate", param="video_url")
    durations = [0.0]
    if stream.duration and stream.time_base:
        durations.append(float(stream.duration * stream.time_base))
    if container.duration:
        durations.append(container.duration / 1_000_000)  # AV_TIME_BASE: microseconds
    total_frames = int(stream.frames) or round(max(durations) * fps)
    durations.append(total_frames / fps)
    duration_s = max(durations)
    _check_walk(limits, duration_s, total_frames, total_frames * width * height)
    if total_frames <= 0:
        raise VideoDecodeError("the video stream has no frames", param="video_url")
    return VideoHeader(VideoMeta(width, height, total_frames, fps), duration_s)


def _check_walk(limits: VideoLimits, duration_s: float, frames: int, pixels: int) -> None:
    if duration_s > limits.max_video_seconds:
        raise _too_large(
            "duration (s)", duration_s, limits.max_video_seconds, "--max-video-seconds"
        )
    if frames > limits.max_video_frames_decoded:
        raise _too_large(
            "frame count", frames, limits.max_video_frames_decoded, "--max-video-frames-decoded"
        )
    if pixels > limits.max_video_decoded_pixels:
        raise _too_large(
            "decoded pixel count",
            pixels,
            limits.max_video_decoded_pixels,
            "--max-video-decoded-pixels",
        )


def decode_video_bytes(
    data: bytes,
    cfg: VideoConfig,
    image_cfg: ImageProcessorConfig,
    limits: VideoLimits,
    *,
    admit: VideoAdmit | None = None,
) -> DecodedVideo:
    """Decode the frames the plan keeps, each resized to the plan's size.

    `admit(header, plan)` runs after the header checks, before the first frame is decoded; it
    may refuse (raise) or return a release, held until the returned video is garbage (or
    called at once if decoding fails).
    """
    import av  # imported here: only processes that decode video pay for FFmpeg

    if not data:
        raise VideoDecodeError("the video is empty (0 bytes)", param="video_url")
    if len(data) > limits.max_video_bytes:
        raise _too_large("size (bytes)", len(data), limits.max_video_bytes, "--max-video-bytes")
    fmt = container_format(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            container = av.open(
                io.BytesIO(data), mode="r", format=fmt, options={"enable_drefs": "0"}
            )
    except (av.FFmpegError, OSError, ValueError, IndexError):
        raise VideoDecodeError(
            "the video container is truncated or corrupt and could not be opened",
            param="video_url",
        ) from None
    release: Release | None = None
    try:
        header = _read_header(container, limits)
        plan = plan_video(header.meta, cfg, image_cfg)
        release = admit(header, plan) if admit is not None else None
        frames, times = _walk(container, header, plan, limits)
    except BaseException:
        if release is not None:
            release()
        raise
    finally:
        container.close()
    video = DecodedVideo(frames, dataclasses.replace(header.meta, frame_times=times), data)
    hold_until_collected(video, release)
    return video


def _walk(
    container, header: VideoHeader, plan: VideoPlan, limits: VideoLimits
) -> tuple[np.ndarray, tuple[tuple[int, float], ...]]:
    """Decode in order up to the last kept index; keep (resized) the planned frames. Returns
    them and the (index, seconds) of each one decoded (its presentation time)."""
    import av

    stream = container.streams.video[0]
    time_base = stream.time_base or Fraction(1, 1)
    start_pts = stream.start_time or 0
    wanted = {idx: k for k, idx in enumerate(plan.frame_indices)}
    last = plan.frame_indices[-1]
    h, w = plan.resized_hw
    kept = np.empty((plan.num_frames, h, w, 3), dtype=np.uint8)
    filled = 0
    walked = pixels = 0
    times: list[tuple[int, float]] = []
    try:
        for frame in container.decode(stream):
            walked += 1
            pixels += frame.width * frame.height
            seconds = float((frame.pts - start_pts) * time_base) if frame.pts is not None else 0.0
            _check_walk(limits, seconds, walked, pixels)
            if frame.width * frame.height > limits.max_video_frame_pixels:
                raise _too_large(
                    "frame size in pixels",
                    frame.width * frame.height,
                    limits.max_video_frame_pixels,
                    "--max-video-frame-pixels",
                )
            k = wanted.get(walked - 1)
            if k is not None:
                rgb = frame.to_ndarray(format="rgb24")  # [H, W, 3] uint8
                kept[k] = resize_frames(rgb[None], h, w)[0]
                filled = k + 1
                times.append((walked - 1, seconds))
            if walked - 1 >= last:
                break
    except (av.FFmpegError, OSError, ValueError) as exc:
        if isinstance(exc, VideoDecodeError):
            raise
        if filled == 0:
            raise VideoDecodeError(
                "the video data is truncated or corrupt and could not be decoded",
                param="video_url",
            ) from None
    if filled == 0:
        raise VideoDecodeError("the video stream decoded to no frames", param="video_url")
    # NOTE: a stream that ends before its header's frame count (truncated, or a header that
    # overstates it) repeats its last decoded frame for the missing indices.
    kept[filled:] = kept[filled - 1]
    return kept, tuple(times)
