"""The runner's side of the EncoderSource: items sent, and what came back for them."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping

import torch

from mmserve.errors import FailureKind, RequestFailure
from mmserve.execution.encoder.runner import EncodeJob, EncoderRunner
from mmserve.execution.encoder.source import EncoderArrival, EncoderSource
from mmserve.multimodal import ItemData, MultiModalFeature, RemoteItem

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteResults:
    """What one step took from the source: items now in the encoder cache, items failed."""

    arrived: list[str]
    failed: dict[str, RequestFailure]


class RemoteItemIntake:
    """Sends remote items to an `EncoderSource` and puts what arrives into the encoder cache.

    It keeps the items it sent and has not heard of (`pending`): a reply for anything else
    (cancelled since, or never sent) is dropped, so the cache only ever holds what the
    scheduler's ledger counts. Without a source (a server with no encoder pool) every remote
    item fails with an internal error: the factory never lets one reach such a runner.

    `embedding_width` is the model's encoder output row width (`ModelConfig.mm_embedding_width`:
    hidden size x (1 + DeepStack levels)); an item arrives as [num_embeds, embedding_width].
    """

    def __init__(
        self, source: EncoderSource | None, encoder: EncoderRunner, embedding_width: int
    ) -> None:
        self.source = source
        self.encoder = encoder
        self.embedding_width = embedding_width
        self.pending: dict[str, MultiModalFeature] = {}  # identifier -> the feature sent
        self.num_dropped = 0  # replies for items not pending (cancelled or unknown)

    def cancel(self, identifiers: Iterable[str]) -> None:
        """The scheduler freed these: those still pending are cancelled at the source."""
        cancelled = [i for i in identifiers if self.pending.pop(i, None) is not None]
        if cancelled and self.source is not None:
            self.source.cancel(cancelled)

    def submit(
        self,
        remote_inputs: Mapping[str, list[MultiModalFeature]],
        item_data: Callable[[str], ItemData | None],
    ) -> dict[str, RequestFailure]:
        """Send the step's remote items (their `RemoteItem` from `item_data`); without a
        source they fail at once (returned)."""
        failed: dict[str, RequestFailure] = {}
        for request_id, features in remote_inputs.items():
            for feature in features:
                item = item_data(feature.identifier)
                if not isinstance(item, RemoteItem):
                    failed[feature.identifier] = RequestFailure(
                        f"image item {feature.identifier[:16]} of request {request_id}: the "
                        "engine no longer holds it to send to the encoder pool",
                        FailureKind.INTERNAL,
                    )
                elif self.source is None:
                    failed[feature.identifier] = RequestFailure(
                        f"image item {feature.identifier[:16]} of request {request_id} is to be "
                        "encoded by an encoder pool, but this engine has none (a bug in how "
                        "the engine was built)",
                        FailureKind.INTERNAL,
                    )
                elif feature.identifier not in self.pending:
                    self.source.submit(request_id, feature, item)
                    self.pending[feature.identifier] = feature
        return failed

    def collect(self) -> RemoteResults:
        """Drain the source: embeddings are checked and cached, fallback pixels encoded here."""
        if self.source is None:
            return RemoteResults([], {})
        # NOTE: polled even with nothing pending, so late replies are drained (and dropped).
        arrivals, failures = self.source.poll()
        arrived: list[str] = []
        failed: dict[str, RequestFailure] = {}
        for failure in failures:
            if self.pending.pop(failure.identifier, None) is None:
                self.num_dropped += 1
                continue
            failed[failure.identifier] = failure.failure
        for arrival in arrivals:
            feature = self.pending.pop(arrival.identifier, None)
            if feature is None:
                self.num_dropped += 1
                continue
            problem = self._take(feature, arrival)
            if problem is None:
                arrived.append(arrival.identifier)
            else:
                self.encoder.cache.free([arrival.identifier])
                logger.error("image item %s: %s", arrival.identifier[:16], problem)
                failed[arrival.identifier] = RequestFailure(
                    f"image item {arrival.identifier[:16]}: {problem}", FailureKind.INTERNAL
                )
        return RemoteResults(arrived, failed)

    def wait(self, timeout_s: float) -> None:
        """Block until the source has something for a pending item, or `timeout_s` passed."""
        if self.source is not None and self.pending:
            self.source.wait(timeout_s)

    def shutdown(self) -> None:
        self.pending.clear()
        if self.source is not None:
            self.source.shutdown()

    def _take(self, feature: MultiModalFeature, arrival: EncoderArrival) -> str | None:
        """Cache the arrival's embeddings; the mismatch, in words, or None."""
        expected = (feature.num_embeds, self.embedding_width)
        if arrival.pixels is not None:  # the pool fell back to this side's vision tower
            if tuple(arrival.pixels.grid_thw) != tuple(feature.grid_thw):
                return (
                    f"fallback pixels have grid {tuple(arrival.pixels.grid_thw)}, the prompt "
                    f"planned {tuple(feature.grid_thw)}"
                )
            try:
                self.encoder.encode([EncodeJob(feature, arrival.pixels)])
            except Exception as exc:  # noqa: BLE001 - fails the requests holding the item
                logger.exception("encoding fallback pixels failed")
                return f"encoding its fallback pixels failed: {type(exc).__name__}"
            emb = self.encoder.cache.get(feature.identifier)
            assert emb is not None
            if tuple(emb.shape) != expected:
                return f"the vision tower gave {tuple(emb.shape)} embeddings, expected {expected}"
            return None
        emb = arrival.embeddings
        assert emb is not None  # an arrival carries embeddings or pixels
        if tuple(emb.shape) != expected or not torch.is_floating_point(emb):
            return (
                f"{arrival.encoder or 'the encoder'} sent {emb.dtype} embeddings of shape "
                f"{tuple(emb.shape)}, expected floating point {list(expected)}"
            )
        self.encoder.cache.put(feature.identifier, emb)
        return None
