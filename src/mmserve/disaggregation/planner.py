"""HttpUrlPlanner: the API process asks an encoder to fetch and plan an http(s) image.

`POST /v1/encode/plan {"url", "min_pixels", "max_pixels"}` on one encoder of the pool (the
healthy ones in turn, each at most once per plan). The encoder fetches under its URL policy
(the same flags as `serve`) and answers the digest, the size and the grid; a refusal comes back
as the error JSON a local fetch would give and is raised here as the same typed error, so a
client sees the same 400 whichever server fetched. When no encoder answers, UrlPlanUnavailable
lets the input processor take the local path (or fail, with `--encoder-fallback fail`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence

import httpx

from mmserve.disaggregation.discovery import auth_headers, normalise_encoder_url
from mmserve.errors import (
    ImageDecodeError,
    ImageTooLargeError,
    InvalidRequestError,
    MediaError,
    MediaFetchRefusedError,
)
from mmserve.processing.url_planner import UrlPlan, UrlPlanUnavailable

logger = logging.getLogger(__name__)

# The encoder's error codes (protocol.INPUT_ERROR_CODES and mmserve.errors' own codes) -> the
# error a local fetch or decode raises for the same fault.
_ERRORS: dict[str, type[InvalidRequestError]] = {
    "fetch_refused": MediaFetchRefusedError,
    "media_url_refused": MediaFetchRefusedError,
    "fetch_failed": MediaError,
    "invalid_media": MediaError,
    "invalid_image": ImageDecodeError,
    "image_too_large": ImageTooLargeError,
}
DOWN_FOR_S = 5.0  # an encoder that failed a plan is tried last for this long


class HttpUrlPlanner:
    """UrlPlanner over the pool's HTTP routes; one AsyncClient per event loop."""

    def __init__(
        self,
        encoder_urls: Sequence[str],
        *,
        secret: bytes | None,
        timeout_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`transport`: httpx's (tests pass a MockTransport); None: the network."""
        if not encoder_urls:
            raise ValueError("HttpUrlPlanner needs at least one encoder URL")
        if timeout_s <= 0:
            raise ValueError(f"the plan timeout must be > 0 s, got {timeout_s}")
        self.encoder_urls = tuple(normalise_encoder_url(u) for u in encoder_urls)
        self.timeout_s = timeout_s
        self._headers = auth_headers(secret)
        self._transport = transport
        self._down_until = dict.fromkeys(self.encoder_urls, 0.0)
        self._turn = itertools.count()
        self._client: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient] | None = None

    async def plan(self, url: str, *, min_pixels: int, max_pixels: int) -> UrlPlan:
        body = {"url": url, "min_pixels": min_pixels, "max_pixels": max_pixels}
        problems = []
        for encoder in self._order():
            try:
                resp = await self._http().post(
                    f"{encoder}/v1/encode/plan", json=body, headers=self._headers
                )
            except httpx.HTTPError as exc:
                problems.append(self._failed(encoder, f"{type(exc).__name__}"))
                continue
            if 400 <= resp.status_code < 500 and resp.status_code not in (401, 403):
                raise _input_error(resp)
            plan = _plan(resp) if resp.status_code == 200 else None
            if plan is None:
                problems.append(self._failed(encoder, f"HTTP {resp.status_code}"))
                continue
            self._down_until[encoder] = 0.0
            return plan
        raise UrlPlanUnavailable(f"no encoder could plan the image URL ({'; '.join(problems)})")

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client[1].aclose()
            self._client = None

    def _order(self) -> list[str]:
        """Healthy encoders first, in turns (plans spread over them), then the others."""
        start = next(self._turn) % len(self.encoder_urls)
        turn = self.encoder_urls[start:] + self.encoder_urls[:start]
        now = time.monotonic()
        return sorted(turn, key=lambda u: self._down_until[u] > now)

    def _failed(self, encoder: str, what: str) -> str:
        logger.warning("encoder %s could not plan an image URL: %s", encoder, what)
        self._down_until[encoder] = time.monotonic() + DOWN_FOR_S
        return f"{encoder}: {what}"

    def _http(self) -> httpx.AsyncClient:
        # An AsyncClient belongs to the event loop it first ran on; the server has one, tests
        # may drive the planner from successive asyncio.run() calls.
        loop = asyncio.get_running_loop()
        if self._client is None or self._client[0] is not loop:
            client = httpx.AsyncClient(
                timeout=self.timeout_s, trust_env=False, transport=self._transport
            )
            self._client = (loop, client)
        return self._client[1]


def _input_error(resp: httpx.Response) -> InvalidRequestError:
    """The typed error of a 4xx plan answer `{"error": {"code", "message", "param"}}`."""
    try:
        error = resp.json()["error"]
        code, message = str(error["code"]), str(error["message"])
        param = error.get("param") or "image_url"
    except (ValueError, KeyError, TypeError):
        return MediaError(
            f"the encoder refused the image URL (HTTP {resp.status_code})", param="image_url"
        )
    return _ERRORS.get(code, InvalidRequestError)(message, param=str(param))


def _plan(resp: httpx.Response) -> UrlPlan | None:
    """The plan in a 200 answer; None when it is not one (the encoder is then at fault)."""
    try:
        body = resp.json()
        digest, width, height = body["content_digest"], body["width"], body["height"]
        grid = tuple(body["grid_thw"])
    except (ValueError, KeyError, TypeError):
        return None
    numbers = (width, height, *grid)
    if not isinstance(digest, str) or len(digest) != 64 or len(grid) != 3:
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in numbers):
        return None
    return UrlPlan(digest, width, height, (grid[0], grid[1], grid[2]))
