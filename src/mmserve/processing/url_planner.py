"""The seam through which a disaggregated server plans an http(s) image without fetching it.

The language-model server never downloads URL media when an encoder pool serves it: the pool
fetches the image, and answers its size, its patch grid and the digest of its bytes (the
item's identity is computed from that digest). `mmserve.disaggregation.planner` implements it
over HTTP; processing only knows this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class UrlPlan:
    """What the pool found at a URL: the digest of its bytes and the image's plan."""

    content_digest: str  # blake3 hex of the fetched bytes
    width: int
    height: int
    grid_thw: tuple[int, int, int]


class UrlPlanUnavailable(Exception):
    """No encoder could plan the URL (none answered): the caller may take the local path."""


class UrlPlanner(Protocol):
    async def plan(self, url: str, *, min_pixels: int, max_pixels: int) -> UrlPlan:
        """The plan of the image at `url` under these pixel bounds. Raises the same
        InvalidRequestErrors a local fetch and decode would (refused, too large, not an
        image), or UrlPlanUnavailable."""
        ...
