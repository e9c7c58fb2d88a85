"""Typed errors a user can cause. The API turns each into a 4xx with the message as written here."""

from __future__ import annotations


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


class ImageDecodeError(MediaError):
    """The bytes are not an image we can decode, or the image is over the pixel cap."""

    code = "invalid_image"


class ImageTooLargeError(ImageDecodeError):
    """An image (or a request's images together) would need more decode memory than allowed."""

    code = "image_too_large"


class DecodeBusyError(MediaError):
    """Decoding could not start in time because other requests hold the decode-memory budget.

    Not the client's fault and not a failure: the same request may succeed when retried.
    """

    status_code = 503
    code = "server_busy"


class PromptTooLongError(InvalidRequestError):
    code = "prompt_too_long"


class TooManyItemsError(InvalidRequestError):
    code = "too_many_mm_items"


class UnknownMediaUUIDError(InvalidRequestError):
    code = "unknown_media_uuid"


class EncoderItemTooLargeError(InvalidRequestError):
    """One multimodal item needs more encoder-cache slots than the cache can ever hold."""

    code = "mm_item_too_large"


class RequestFailedError(MMServeError):
    """A request failed inside the engine (for example a placeholder/embedding count mismatch).

    Only that request fails; the server keeps serving the others.
    """
