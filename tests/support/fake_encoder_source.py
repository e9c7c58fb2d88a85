"""A real EncoderSource in this process, for tests: the pool's behaviour without its sockets.

It "encodes" a RemoteItem by running `embed` (the model's own vision tower, in the engine
tests) on pixels the test registered for the item's identifier, and delivers the result after
`delay_polls` polls, or once the test releases an item it holds back, or fails it on command.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from mmserve.errors import RequestFailure
from mmserve.execution.encoder.source import EncoderArrival, EncoderItemFailure
from mmserve.multimodal import EncoderInput, MultiModalFeature, RemoteItem

EmbedOne = Callable[[EncoderInput], torch.Tensor]  # pixels -> [num_embeds, hidden]


@dataclass
class FakeEncoderSource:
    embed: EmbedOne
    delay_polls: int = 0
    # True: a cancelled item is still answered (a late reply the runner must drop)
    answers_after_cancel: bool = False
    pixels: dict[str, EncoderInput] = field(default_factory=dict)
    held: set[str] = field(default_factory=set)  # not delivered until `release`
    failures: dict[str, RequestFailure] = field(default_factory=dict)  # answered with these
    fallback: set[str] = field(default_factory=set)  # answered with pixels (local fallback)
    submitted: list[tuple[str, str]] = field(default_factory=list)  # (request id, identifier)
    cancelled: list[str] = field(default_factory=list)
    is_shut_down: bool = False
    _polls_left: dict[str, int] = field(default_factory=dict)  # identifier -> polls to go
    _event: threading.Event = field(default_factory=threading.Event)

    def register(self, identifier: str, pixels: EncoderInput) -> None:
        self.pixels[identifier] = pixels

    def release(self, identifiers: Iterable[str]) -> None:
        """Let held items go (from any thread): the next poll delivers them."""
        self.held -= set(identifiers)
        self._event.set()

    # ---------------------------------------------------------------- EncoderSource

    def submit(self, request_id: str, feature: MultiModalFeature, item: RemoteItem) -> None:
        assert isinstance(item, RemoteItem) and feature.is_remote, "only remote items go here"
        assert feature.identifier in self.pixels, "the test registered no pixels for it"
        self.submitted.append((request_id, feature.identifier))
        self._polls_left.setdefault(feature.identifier, self.delay_polls)

    def cancel(self, identifiers: Iterable[str]) -> None:
        for identifier in identifiers:
            self.cancelled.append(identifier)
            if not self.answers_after_cancel:
                self._polls_left.pop(identifier, None)

    def poll(self) -> tuple[list[EncoderArrival], list[EncoderItemFailure]]:
        arrivals: list[EncoderArrival] = []
        failures: list[EncoderItemFailure] = []
        for identifier in list(self._polls_left):
            if identifier in self.held:
                continue
            if self._polls_left[identifier] > 0:
                self._polls_left[identifier] -= 1
                continue
            del self._polls_left[identifier]
            pixels = self.pixels[identifier]
            if identifier in self.failures:
                failures.append(EncoderItemFailure(identifier, self.failures[identifier]))
            elif identifier in self.fallback:
                arrivals.append(EncoderArrival(identifier, pixels=pixels, encoder="local"))
            else:
                with torch.inference_mode():
                    embeddings = self.embed(pixels)
                arrivals.append(EncoderArrival(identifier, embeddings, encoder="fake"))
        return arrivals, failures

    def wait(self, timeout_s: float) -> None:
        if any(i not in self.held for i in self._polls_left):
            return  # the next poll makes progress
        self._event.wait(timeout_s)
        self._event.clear()

    def num_pending(self) -> int:
        return len(self._polls_left)

    def shutdown(self) -> None:
        self.is_shut_down = True
