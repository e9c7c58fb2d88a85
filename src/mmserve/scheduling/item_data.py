"""What the scheduler knows of item data it never holds: whether a passed item can be encoded
again (the data waits on the executor side, `execution/encoder/pixels.py`)."""

from __future__ import annotations

from typing import Protocol

from mmserve.errors import FailureKind, RequestFailure


class ItemDataHolder(Protocol):
    """The executor side's store of item data, as the scheduler may ask it."""

    def holds(self, identifier: str) -> bool:
        """Whether the item's pixels (or remote item) are still there to encode it again."""
        ...


class PixelsGone(Exception):
    """A preempted request needs an item's pixels the executor side has evicted."""

    def __init__(self, identifier: str) -> None:
        super().__init__(identifier)
        self.identifier = identifier

    def failure(self) -> RequestFailure:
        """What the request that needed the pixels fails with."""
        return RequestFailure(
            f"the engine no longer holds the pixels of item {self.identifier[:16]} to encode "
            "it again after a preemption (raise --mm-reencode-cache-gb)",
            FailureKind.INTERNAL,
        )
