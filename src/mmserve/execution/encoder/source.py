"""Where the runner gets embeddings it does not compute itself: the EncoderSource seam.

A disaggregated server ships its images to a pool of `mmserve encode` servers; the runner
hands those items (each a spec and its `RemoteItem`) to an `EncoderSource` and, at the
start of every step, takes what has arrived. The runner never imports the pool: the factory
wires an implementation in (`mmserve.disaggregation.pool.RemoteEncoderPool`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from mmserve.errors import RequestFailure
from mmserve.multimodal import EncoderInput, MultiModalFeature, RemoteItem


@dataclass(frozen=True, slots=True)
class EncoderArrival:
    """One item's result: its embeddings, or (the local fallback) its pixels to encode here."""

    identifier: str
    embeddings: torch.Tensor | None = None  # [num_embeds, mm_embedding_width], any device, dtype
    pixels: EncoderInput | None = None  # the pool could not encode it: encode these here
    encoder: str = ""  # who answered: an encoder's URL, or "local"

    def __post_init__(self) -> None:
        if (self.embeddings is None) == (self.pixels is None):
            raise ValueError("an encoder arrival carries embeddings or pixels, exactly one")


@dataclass(frozen=True, slots=True)
class EncoderItemFailure:
    """An item nobody could encode: every request that needs it fails with `failure`."""

    identifier: str
    failure: RequestFailure  # kind UNAVAILABLE (503) or REQUEST (400: the input's fault)


class EncoderSource(Protocol):
    """Asynchronous encoding of remote items, polled by the runner once per step.

    All methods are called from the engine's thread; an implementation does its I/O on threads
    of its own and never blocks the caller on the network.
    """

    def submit(self, request_id: str, feature: MultiModalFeature, item: RemoteItem) -> None:
        """Start encoding the item of `feature` (`item` is where its bytes are) for
        `request_id`. An identifier already pending is not sent twice."""
        ...

    def cancel(self, identifiers: Iterable[str]) -> None:
        """Nobody needs these any more: drop their pending work; late replies are dropped."""
        ...

    def poll(self) -> tuple[list[EncoderArrival], list[EncoderItemFailure]]:
        """What has arrived or failed since the last call; never blocks."""
        ...

    def wait(self, timeout_s: float) -> None:
        """Block until `poll` has something to return, or `timeout_s` has passed."""
        ...

    def num_pending(self) -> int:
        """Items submitted and neither arrived, failed nor cancelled."""
        ...

    def shutdown(self) -> None:
        """Close sockets and threads; idempotent."""
        ...
