"""A step's scheduled items through the vision tower: one bad item fails only its requests, and
over a tensor-parallel group every rank ends the step with the same encoder cache.

    --mm-encoder-tp-mode data (default): the tower is replicated; the step's items to encode
        are split across the ranks by patch cost (`split_by_patches`, the same on every rank),
        each rank encodes its share, and the embeddings are gathered so every rank's cache
        holds every item:

            rank 0  encode share 0 ─┐ rows per item (all_reduce) ─┐ pad to the largest share,
            rank 1  encode share 1 ─┘                             └ all_gather, unpad, put

    --mm-encoder-tp-mode weights: the tower is sharded (its layers all-reduce), so every rank
        encodes every item, in the same calls.

Every rank decides an item's failure the same way (the outcome is exchanged), so a bad item
fails the same requests everywhere and the ranks' request states never diverge.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from mmserve.config.parallel import MM_ENCODER_TP_MODES
from mmserve.errors import FailureKind, RequestFailure
from mmserve.execution.encoder.cache import EncoderCache
from mmserve.execution.encoder.runner import EncodeJob, EncoderRunner
from mmserve.layers.parallel import SINGLE, TPGroup

logger = logging.getLogger(__name__)


def split_by_patches(jobs: Sequence[EncodeJob], size: int) -> list[list[EncodeJob]]:
    """Each rank's share of `jobs`: greedy longest-processing-time by input patches, ties
    broken by identifier, so every rank computes the same split. Within a share, items keep
    that order (largest first)."""
    order = sorted(jobs, key=lambda j: (-j.feature.num_patches, j.feature.identifier))
    shares: list[list[EncodeJob]] = [[] for _ in range(size)]
    loads = [0] * size
    for job in order:
        rank = min(range(size), key=lambda r: (loads[r], r))
        shares[rank].append(job)
        loads[rank] += job.feature.num_patches
    return shares


class StepEncoder:
    """Encodes the (request, item) pairs a step schedules into the encoder's cache; failures
    go to `errors` by request. With `tp` SINGLE it is the plain local path: no collective, no
    copy. The encoder is an argument of each call (the runner's, which tests may replace)."""

    def __init__(
        self,
        *,
        tp: TPGroup = SINGLE,
        mode: str = "data",
        embedding_width: int = 0,
    ) -> None:
        """`embedding_width`: an item's row width (`mm_embedding_width`); data mode needs it
        to gather on a rank whose share is empty."""
        if mode not in MM_ENCODER_TP_MODES:
            raise ValueError(f"mm_encoder_tp_mode must be one of {MM_ENCODER_TP_MODES}: {mode!r}")
        if tp.size > 1 and mode == "data" and embedding_width < 1:
            raise ValueError("data-parallel encoding needs the embedding width to gather rows")
        self.tp = tp
        self.mode = mode
        self.embedding_width = embedding_width

    def encode(
        self,
        encoder: EncoderRunner,
        features: Sequence[tuple[str, EncodeJob]],
        errors: dict[str, RequestFailure],
    ) -> None:
        """Run every item of `features` not yet cached through the tower, in as few calls as
        the budget allows; the requests of an item that fails get an INTERNAL failure."""
        if not features:
            return
        if self.tp.size == 1:
            failed = _encode_local(encoder, [job for _, job in features])
        elif self.mode == "weights":
            failed = self._encode_sharded(encoder, _todo(features, encoder.cache))
        else:
            failed = self._encode_split(encoder, _todo(features, encoder.cache))
        for request_id, job in features:
            message = failed.get(job.feature.identifier)
            if message is not None:
                errors[request_id] = RequestFailure(message, FailureKind.INTERNAL)

    def _encode_split(self, encoder: EncoderRunner, todo: list[EncodeJob]) -> dict[str, str]:
        """Data mode: this rank's share here, then every share into every rank's cache."""
        if not todo:  # the same on every rank: every rank skips the exchange
            return {}
        shares = split_by_patches(todo, self.tp.size)
        failed = _encode_local(encoder, shares[self.tp.rank])
        rows = self._exchange_rows(encoder.cache, todo, shares, failed)
        self._gather(encoder.cache, shares, rows)
        for rank, share in enumerate(shares):
            for job in share:
                identifier = job.feature.identifier
                if rows[identifier] < 0 and identifier not in failed:
                    failed[identifier] = (
                        f"encoding multimodal item failed on tensor-parallel rank {rank}"
                    )
        if self.tp.is_first:
            encoder.count_encoded(
                [job for r, share in enumerate(shares) if r != 0 for job in share]
            )
        return failed

    def _exchange_rows(
        self,
        cache: EncoderCache,
        todo: list[EncodeJob],
        shares: list[list[EncodeJob]],
        failed: dict[str, str],
    ) -> dict[str, int]:
        """Every item's row count, -1 for an item that failed on its rank: each rank fills
        its own items' places (rows + 1, 0 when failed) and the group sums them."""
        index = {job.feature.identifier: i for i, job in enumerate(todo)}
        counts = torch.zeros(len(todo), dtype=torch.int64, device=cache.device)  # [items]
        for job in shares[self.tp.rank]:
            identifier = job.feature.identifier
            emb = None if identifier in failed else cache.get(identifier)
            counts[index[identifier]] = 0 if emb is None else emb.shape[0] + 1
        summed = self.tp.all_reduce(counts).tolist()
        return {job.feature.identifier: summed[i] - 1 for i, job in enumerate(todo)}

    def _gather(
        self, cache: EncoderCache, shares: list[list[EncodeJob]], rows: dict[str, int]
    ) -> None:
        """Every rank's encoded rows into every rank's cache: padded to the largest share,
        all-gathered, unpadded."""
        share_rows = [sum(max(0, rows[j.feature.identifier]) for j in share) for share in shares]
        padded = max(share_rows)
        if padded == 0:
            return
        mine = [
            emb
            for job in shares[self.tp.rank]
            if (emb := cache.get(job.feature.identifier)) is not None
            and rows[job.feature.identifier] >= 0
        ]
        width = self.embedding_width
        local = torch.zeros(padded, width, dtype=cache.dtype, device=cache.device)
        if mine:
            joined = torch.cat(mine) if len(mine) > 1 else mine[0]  # [share_rows, width]
            local[: joined.shape[0]] = joined
        everyone = self.tp.all_gather(local, dim=0)  # [size * padded, width]
        for rank, share in enumerate(shares):
            if rank == self.tp.rank:
                continue
            offset = rank * padded
            for job in share:
                n = rows[job.feature.identifier]
                if n < 0:
                    continue
                # a copy: the cache keeps its own tensor, not a view of the gathered block
                cache.put(job.feature.identifier, everyone[offset : offset + n].clone())
                offset += n

    def _encode_sharded(self, encoder: EncoderRunner, todo: list[EncodeJob]) -> dict[str, str]:
        """Weights mode: every rank runs every item through its shard of the tower.

        NOTE: the tower's layers all-reduce, so the ranks must make the same calls. Whether the
        batched calls failed is agreed first; if they failed anywhere, every rank drops what
        they cached and runs every item alone, in the same order (a rank whose calls
        succeeded would otherwise skip the items it holds). An item that failed on any rank
        fails everywhere and leaves every cache. A failure on one rank only, inside the tower
        before its collectives, leaves the others waiting in them: that is a rank lost, for
        the executor's step timeout and health check, not a request's failure.
        """
        if not todo:  # the same on every rank
            return {}
        failed: dict[str, str] = {}
        try:
            encoder.encode(todo)
            batch_failed = 0
        except Exception as exc:  # noqa: BLE001 - retried item by item, on every rank
            logger.warning("batched encoder call failed (%s); retrying item by item", exc)
            batch_failed = 1
        cache = encoder.cache
        flag = torch.tensor([batch_failed], dtype=torch.int64, device=cache.device)
        if self.tp.all_reduce(flag).item() > 0:
            cache.free([job.feature.identifier for job in todo])
            failed = _encode_each(encoder, todo)
        flags = torch.tensor(
            [int(job.feature.identifier in failed) for job in todo],
            dtype=torch.int64,
            device=cache.device,
        )  # [items]
        anywhere = self.tp.all_reduce(flags).tolist()
        for job, count in zip(todo, anywhere, strict=True):
            identifier = job.feature.identifier
            if count > 0:
                cache.free([identifier])
                failed.setdefault(
                    identifier, "encoding multimodal item failed on another tensor-parallel rank"
                )
        return failed


def _encode_local(encoder: EncoderRunner, jobs: Sequence[EncodeJob]) -> dict[str, str]:
    """Encode `jobs` here; the failed items' identifiers and their messages."""
    try:
        encoder.encode(jobs)
        return {}
    except Exception as exc:  # noqa: BLE001 - the retry below finds the item at fault
        # One bad item must fail only its own requests: retry item by item. The traceback
        # is logged once, by the item that fails again.
        logger.warning("batched encoder call failed (%s); retrying item by item", exc)
    return _encode_each(encoder, jobs)


def _encode_each(encoder: EncoderRunner, jobs: Sequence[EncodeJob]) -> dict[str, str]:
    failed: dict[str, str] = {}
    for job in jobs:
        identifier = job.feature.identifier
        if identifier in failed:
            continue
        try:
            encoder.encode([job])
        except Exception as exc:  # noqa: BLE001 - reported to the item's requests only
            logger.exception("encoding multimodal item %s failed", identifier[:16])
            failed[identifier] = f"encoding multimodal item failed: {type(exc).__name__}"
    return failed


def _todo(features: Sequence[tuple[str, EncodeJob]], cache: EncoderCache) -> list[EncodeJob]:
    """The distinct items not yet cached, in order of first appearance (the same on every
    rank: the scheduler's output and the caches are)."""
    todo: dict[str, EncodeJob] = {}
    for _, job in features:
        identifier = job.feature.identifier
        if identifier not in cache and identifier not in todo:
            todo[identifier] = job
    return list(todo.values())
