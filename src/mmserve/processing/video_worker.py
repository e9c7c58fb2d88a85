"""Video decodes in the decode worker processes: the spec sent, the header back, the frames.

Same four steps as an image (worker_protocol.py), no pickle:
  (1) parent -> worker  b"V" + JSON {video config, patch geometry, limits}, then the bytes
  (2) worker -> parent  b"H" + JSON {width, height, total_frames, video_fps, duration_s}
  (3) parent -> worker  b"G" or b"S" (the parent's admit: decode memory)
  (4) worker -> parent  b"K" + <Q rss> + <III num_frames, height, width>, then the frames'
                        bytes [num_frames, height, width, 3] uint8; or b"E" with a typed error
"""

from __future__ import annotations

import dataclasses
import json
import struct
from multiprocessing.connection import Connection

import numpy as np

from mmserve.config.media import VideoLimits
from mmserve.errors import InvalidRequestError, MediaError, VideoDecodeError
from mmserve.processing.decode_budget import Release, hold_until_collected
from mmserve.processing.image_processor import ImageProcessorConfig
from mmserve.processing.video_decode import (
    DecodedVideo,
    VideoAdmit,
    VideoHeader,
    decode_video_bytes,
)
from mmserve.processing.video_processor import VideoMeta, VideoPlan, plan_video
from mmserve.processing.video_sampling import VideoConfig
from mmserve.processing.worker_protocol import (
    GO,
    VIDEO_REQUEST,
    Stopped,
    WorkerExchange,
    send_error,
    send_ok,
)

_SHAPE = struct.Struct("<III")
# The patch geometry is all the plan needs of the image processor's configuration.
_GEOMETRY = ("patch_size", "temporal_patch_size", "merge_size")


def _spec(cfg: VideoConfig, image_cfg: ImageProcessorConfig, limits: VideoLimits) -> bytes:
    geometry = {k: getattr(image_cfg, k) for k in _GEOMETRY}
    body = {"video": cfg.__dict__, "geometry": geometry, "limits": dataclasses.asdict(limits)}
    return VIDEO_REQUEST + json.dumps(body).encode()


def _from_spec(raw: bytes) -> tuple[VideoConfig, ImageProcessorConfig, VideoLimits]:
    body = json.loads(raw)
    image_cfg = ImageProcessorConfig(**body["geometry"])
    return VideoConfig(**body["video"]), image_cfg, VideoLimits(**body["limits"])


def serve_video(conn: Connection, data: bytes, spec: bytes) -> None:
    """The worker's side of one video decode."""
    cfg, image_cfg, limits = _from_spec(spec)

    def admit(header: VideoHeader, plan: VideoPlan) -> Release | None:
        meta = header.meta
        fields = [meta.width, meta.height, meta.total_frames, meta.video_fps, header.duration_s]
        conn.send_bytes(b"H" + json.dumps(fields).encode())
        if conn.recv_bytes() != GO:
            raise Stopped
        return None

    try:
        video = decode_video_bytes(data, cfg, image_cfg, limits, admit=admit)
    except MediaError as e:  # ours, typed: the parent raises the same type
        send_error(conn, e)
        return
    except InvalidRequestError as e:  # the plan's refusals (one frame, aspect ratio)
        send_error(conn, VideoDecodeError(e.message, param="video_url"))
        return
    n, h, w, _ = video.frames.shape
    times = json.dumps(video.meta.frame_times).encode()
    send_ok(conn, _SHAPE.pack(n, h, w) + times, video.frames.tobytes())


def decode_video_in_worker(
    pool: WorkerExchange,
    data: bytes,
    cfg: VideoConfig,
    image_cfg: ImageProcessorConfig,
    limits: VideoLimits,
    *,
    admit: VideoAdmit | None = None,
    timeout_s: float | None = None,
) -> DecodedVideo:
    """`decode_video_bytes` in a worker; `admit`'s reservation is held while the result lives."""
    metas: list[VideoMeta] = []

    def on_header(reply: bytes) -> Release | None:
        width, height, total, fps, duration_s = json.loads(reply[1:])
        header = VideoHeader(VideoMeta(int(width), int(height), int(total), float(fps)), duration_s)
        metas.append(header.meta)
        return admit(header, plan_video(header.meta, cfg, image_cfg)) if admit else None

    body, payload, release = pool.exchange(
        _spec(cfg, image_cfg, limits), data, on_header, timeout_s, "video"
    )
    n, h, w = _SHAPE.unpack_from(body)
    times = _frame_times(body[_SHAPE.size :])
    if not metas or len(payload) != n * h * w * 3 or times is None:
        if release is not None:
            release()
        raise VideoDecodeError("the video decode worker sent a malformed reply")
    frames = np.frombuffer(payload, dtype=np.uint8).reshape(n, h, w, 3)
    video = DecodedVideo(frames, dataclasses.replace(metas[0], frame_times=times), data)
    hold_until_collected(video, release)
    return video


def _frame_times(raw: bytes) -> tuple[tuple[int, float], ...] | None:
    """The kept frames' (index, seconds) from the K reply (None if malformed)."""
    try:
        pairs = json.loads(raw)
        return tuple((int(i), float(t)) for i, t in pairs)
    except (ValueError, TypeError):
        return None
