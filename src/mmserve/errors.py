"""Typed errors mmserve raises on purpose, and how the engine says why one request failed.

The API turns each `InvalidRequestError` into a 4xx with the message as written here.
"""

from __future__ import annotations

import enum

import msgspec


class MMServeError(Exception):
    """Base class of every error mmserve raises on purpose."""


class InvalidRequestError(MMServeError, ValueError):
    """The request is malformed or breaks a limit; the message says which and how to fix it.

    `param` names the offending field where one exists (OpenAI's error `param`), `status_code`
    is the HTTP status the server answers with.
    """

    status_code = 400
    code = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class MediaError(InvalidRequestError):
    """A media item could not be fetched, read or decoded."""

    code = "invalid_media"


class MediaFetchRefusedError(MediaError):
    """A URL was refused before or during fetching (scheme, host, address, redirect, size)."""

    code = "media_url_refused"


class MediaFetchBusyError(MediaError):
    """Every media fetch slot stayed busy for the fetch timeout: the server, not the request."""

    status_code = 503
    code = "media_fetch_busy"


class ImageDecodeError(MediaError):
    """The bytes are not an image we can decode, or the image is over the pixel cap."""

    code = "invalid_image"


class ImageTooLargeError(ImageDecodeError):
    """An image (or a request's images together) would need more decode memory than allowed."""

    code = "image_too_large"


class VideoDecodeError(MediaError):
    """The bytes are not a video we can decode (container, stream, frames)."""

    code = "invalid_video"


class VideoTooLargeError(VideoDecodeError):
    """A video is over an engine ceiling: bytes, duration, frames, frame size or pixels."""

    code = "video_too_large"


class DecodeBusyError(MediaError):
    """Decoding could not start in time because other requests hold the decode-memory budget.

    Not the client's fault and not a failure: the same request may succeed when retried.
    """

    status_code = 503
    code = "server_busy"


class EncoderUnavailableError(InvalidRequestError):
    """The encoder pool could not take an item and the server may not fall back to its own
    vision stage (--encoder-fallback fail): the server's state, not the request (503, retry)."""

    status_code = 503
    code = "encoder_unavailable"


class NoReplicaAvailableError(InvalidRequestError):
    """Every data-parallel replica is down (each is being restarted): the server's state, not
    the request's (503, retry)."""

    status_code = 503
    code = "no_replica_available"


class PromptTooLongError(InvalidRequestError):
    code = "prompt_too_long"


class TooManyItemsError(InvalidRequestError):
    code = "too_many_mm_items"


class UnknownMediaUUIDError(InvalidRequestError):
    code = "unknown_media_uuid"


class EncoderItemTooLargeError(InvalidRequestError):
    """One multimodal item needs more encoder budget or cache than the engine can ever give."""

    code = "mm_item_too_large"


class RequestFailedError(MMServeError):
    """A request failed inside the engine because of its own content (for example a
    placeholder/embedding count mismatch). Only that request fails; answered with a 400.
    """


class InternalRequestError(MMServeError):
    """The engine failed one request through no fault of the client (a bug, the device).

    Answered with a 500 whose message names the request id, so that a client's report can be
    matched to the one server log line that has the traceback.
    """

    def __init__(self, request_id: str) -> None:
        super().__init__(
            f"internal error while running request {request_id}; the server log has the traceback"
        )
        self.request_id = request_id


class EngineDeadError(MMServeError):
    """The engine loop has stopped: no request can run until the server is restarted.

    The message clients see is generic; `reason` (for the log) says what stopped it.
    """

    def __init__(self, reason: str) -> None:
        super().__init__("the engine has stopped; restart the server (the server log says why)")
        self.reason = reason


class ServerShuttingDownError(MMServeError):
    """The server is draining after SIGTERM and takes no new requests (answered 503)."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down and takes no new requests; retry elsewhere")


class FailureKind(enum.Enum):
    """Whose fault a failed request is; it decides the status the request is answered with."""

    REQUEST = "request"  # its own content or parameters: the client can fix it (400)
    INTERNAL = "internal"  # the server failed (a bug, the device): 500 with the request id
    UNAVAILABLE = "unavailable"  # a service it needs is down (the encoder pool): 503, retry


class RequestFailure(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Why the engine ended one request with an error; every other request goes on.

    The same value in-process and on the wire (`kind` travels as its value). For INTERNAL
    failures `message` is for the server log and offline users: the HTTP answer
    does not repeat it (it may carry library text).
    """

    message: str
    kind: FailureKind
    param: str | None = None  # the request field at fault, for REQUEST failures
