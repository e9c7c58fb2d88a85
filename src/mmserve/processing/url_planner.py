"""The seam through which a disaggregated server plans http(s) images: the encoder pool
fetches them, the language-model side only learns their digest, size and grid."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class UrlPlan:
    """What an encoder found at a URL: the digest of the bytes it fetched, their image size
    (as the decode path sees it) and the grid it will encode under the given min/max pixels."""

    content_digest: str  # blake3 hex of the fetched bytes
    width: int
    height: int
    grid_thw: tuple[int, int, int]


class UrlPlanUnavailable(Exception):  # noqa: N818 - the name the design fixes
    """No encoder could plan the URL (none healthy, none answered): not the request's fault."""


class UrlPlanner(Protocol):
    """Plans an http(s) image on the encoder pool.

    Raises the same `InvalidRequestError`s a local fetch and decode would (refused URL, too
    large, not an image) when the input is at fault, and `UrlPlanUnavailable` when no encoder
    answered. `plan` may be awaited on different event loops (the offline API runs each call
    on a fresh loop), so an implementation must not bind itself to one loop.
    """

    async def plan(self, url: str, *, min_pixels: int, max_pixels: int) -> UrlPlan: ...
