"""What the encoder pool's I/O thread tracks: its settings, the items it is encoding, one link
per encoder (with its health), and the seam through which it hands results back."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import zmq

from mmserve.disaggregation.discovery import ModelIdentity
from mmserve.disaggregation.protocol import EncodeItem
from mmserve.errors import RequestFailure
from mmserve.multimodal import MultiModalFeature, RemoteItem


@dataclass(frozen=True, slots=True)
class IOConfig:
    identity: ModelIdentity
    timeout_s: float  # one attempt's deadline
    secret: bytes | None
    ping_interval_s: float
    # a healthy encoder that leaves a ping unanswered this many intervals is out of rotation
    missed_pings: int
    send_hwm: int  # messages queued towards one encoder at most


@dataclass(slots=True)
class PendingItem:
    """One item the pool is encoding; owned by the I/O thread once posted."""

    request_id: str
    item_index: int  # its ordinal among the request's items in the pool at once (for logs)
    feature: MultiModalFeature
    item: RemoteItem  # where its bytes are
    generation: int  # the engine side's submission number (a result of an older one is dropped)
    attempt: int = 0
    encoder: EncoderLink | None = None
    sent_at_s: float = 0.0
    deadline_s: float = math.inf
    tried: set[str] = field(default_factory=set)
    last_error: str = ""

    def message(self) -> EncodeItem:
        """Its EncodeItem for the current attempt."""
        return EncodeItem(
            self.request_id, self.item_index, self.feature.identifier, self.attempt, self.item
        )

    def describe(self) -> str:
        return (
            f"image item {self.item_index} (prompt offset {self.feature.placeholder.offset}) "
            f"of request {self.request_id}"
        )


@dataclass(slots=True)
class EncoderLink:
    """One encoder as the I/O thread sees it."""

    url: str
    socket: zmq.Socket
    last_pong_s: float
    is_healthy: bool = True
    outstanding_patches: int = 0  # input patches of our items it has not answered
    queued_patches: int = 0  # its own queue depth, from its last Pong
    ping_nonce: int = 0
    next_ping_s: float = 0.0
    unanswered_since_s: float | None = None  # when the oldest ping it has not answered went out
    rejoin_after_nonce: int = 0  # out of rotation: only a pong to a later ping brings it back
    # times taken out since it last encoded an item; from the second on, it rejoins only after
    # a doubling wait (an encoder that answers pings but hangs on items is not re-tried hot)
    strikes: int = 0
    rejoin_not_before_s: float = 0.0

    @property
    def load(self) -> int:
        return self.outstanding_patches + self.queued_patches


class PoolSink(Protocol):
    """Where the I/O thread hands finished items (the pool, on the engine side)."""

    def arrived(self, p: PendingItem, embeddings: torch.Tensor, encoder: str) -> None: ...

    def failed(self, p: PendingItem, failure: RequestFailure) -> None: ...

    def fallback(self, p: PendingItem) -> None: ...

    def io_failed(self, reason: str) -> None:
        """The I/O thread has stopped on a bug: nothing pending will ever be answered."""
        ...


MAX_REJOIN_BACKOFF_S = 30.0


def rejoin_backoff_s(strikes: int, ping_interval_s: float) -> float:
    """How long an encoder taken out for the `strikes`-th time in a row stays out at least: no
    wait the first time (it rejoins on its next pong), then 2, 4, 8, ... ping intervals, at
    most MAX_REJOIN_BACKOFF_S."""
    if strikes <= 1:
        return 0.0
    return min(ping_interval_s * 2 ** (strikes - 1), MAX_REJOIN_BACKOFF_S)
