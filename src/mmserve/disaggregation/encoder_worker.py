"""The encoder's batching loop behind its ZMQ ROUTER: items from every client, deduplicated by
the encoder's own content key, packed up to the patch budget, one vision call per batch.

An item's life (all on one event loop; CPU and device work run in pools):

    recv ─> waiter ─> read bytes ─> digest == planned? ─> key ─┬─ cache hit ──────────> answer
                                                             ├─ job in flight: join ─> answer
                                                             └─ new job ─> decode + process
                                                                 ─> ready ─> batch ─> vision
                                                                 ─> cache ─> answer every waiter

A waiter is one (client, identifier, attempt); a job is one content key being produced, with
every waiter that asked for it. Malformed messages are counted and dropped; nothing a client
sends can stop the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from mmserve.disaggregation.embedding_cache import ByteBudgetLRU, CachedEmbedding
from mmserve.disaggregation.encoder_metrics import EncoderMetrics
from mmserve.disaggregation.media_stage import ItemError, MediaStage, content_key
from mmserve.disaggregation.protocol import (
    Cancel,
    EncodeItem,
    EncodeResult,
    MalformedMessage,
    Message,
    Ping,
    Pong,
    content_digest,
    decode_message,
    encode_message,
)
from mmserve.disaggregation.vision_stage import VisionStage
from mmserve.grid import grid_num_patches
from mmserve.multimodal import EncoderInput

logger = logging.getLogger(__name__)

# Most items waiting at once (all clients): past it an item is answered "overloaded" at once,
# so the LM side sends it elsewhere instead of waiting on a queue that cannot drain in time.
MAX_QUEUED_ITEMS = 4096

Ticket = tuple[bytes, str, int]  # (client routing id, identifier, attempt)


@dataclass(slots=True, eq=False)
class _Waiter:
    client: bytes
    item: EncodeItem
    is_finished: bool = False  # answered, or cancelled

    @property
    def ticket(self) -> Ticket:
        return (self.client, self.item.identifier, self.item.attempt)

    @property
    def num_patches(self) -> int:
        return grid_num_patches(self.item.item.grid_thw)


@dataclass(slots=True, eq=False)
class _Job:
    key: str
    waiters: list[_Waiter] = field(default_factory=list)
    processed: EncoderInput | None = None

    def has_waiters(self) -> bool:
        return any(not w.is_finished for w in self.waiters)


class EncoderWorker:
    """Owns the ROUTER socket (bound by the caller) and everything queued behind it."""

    def __init__(
        self,
        *,
        socket: zmq.asyncio.Socket,
        media: MediaStage,
        vision: VisionStage,
        cache: ByteBudgetLRU[CachedEmbedding],
        metrics: EncoderMetrics,
        fingerprint: str,
        patch_budget: int,
        secret: bytes | None,
    ) -> None:
        self._socket = socket
        self._media = media
        self._vision = vision
        self._cache = cache
        self._metrics = metrics
        self._fingerprint = fingerprint
        self._patch_budget = patch_budget
        self._secret = secret
        self._vision_pool = ThreadPoolExecutor(1, thread_name_prefix="mmserve-encode-vision")
        self._tickets: dict[Ticket, _Waiter] = {}
        self._jobs: dict[str, _Job] = {}
        self._ready: deque[_Job] = deque()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.queued_patches = 0

    @property
    def num_queued(self) -> int:
        return len(self._tickets)

    async def run(self) -> None:
        """Receive and encode until cancelled."""
        batching = asyncio.create_task(self._batch_loop())
        try:
            while True:
                frames = await self._socket.recv_multipart(copy=False)
                try:
                    self._on_frames(frames)
                except Exception:  # noqa: BLE001 - a bug must not stop the encoder
                    logger.exception("encoder: a message could not be handled")
        finally:
            batching.cancel()
            for waiter in list(self._tickets.values()):
                self._fail(waiter, "shutting_down", "the encoder is shutting down")
            for task in list(self._tasks):
                task.cancel()
            self._vision_pool.shutdown(wait=False, cancel_futures=True)

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        client = frames[0].bytes  # the ROUTER puts the sender's routing id first
        try:
            msg, payload = decode_message([f.buffer for f in frames[1:]], self._secret)
        except MalformedMessage as exc:
            self._metrics.malformed.labels(exc.reason).inc()
            return
        if isinstance(msg, EncodeItem):
            self._on_item(client, msg, bytes(payload))
        elif isinstance(msg, Cancel):
            self._on_cancel(client, msg)
        elif isinstance(msg, Ping):
            pong = Pong(msg.nonce, self.queued_patches, self._fingerprint)
            self._send(client, pong)
        else:  # a result or a pong: only an encoder sends those
            self._metrics.malformed.labels("unexpected_kind").inc()

    def _on_item(self, client: bytes, item: EncodeItem, payload: bytes) -> None:
        self._metrics.items_received.inc()
        self._metrics.received_bytes.inc(len(payload))
        waiter = _Waiter(client, item)
        if len(self._tickets) >= MAX_QUEUED_ITEMS:
            self._metrics.item_errors.labels("overloaded").inc()
            msg = f"the encoder has {MAX_QUEUED_ITEMS} items queued; send it elsewhere"
            self._send(client, self._error_result(item, "overloaded", msg))
            return
        previous = self._tickets.get(waiter.ticket)
        if previous is not None:  # the same attempt sent twice: the newer one is answered
            self._finish(previous)
        self._tickets[waiter.ticket] = waiter
        self.queued_patches += waiter.num_patches
        task = asyncio.create_task(self._admit_safely(waiter, payload))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_cancel(self, client: bytes, msg: Cancel) -> None:
        for identifier, attempt in zip(msg.identifiers, msg.attempts, strict=True):
            waiter = self._tickets.get((client, identifier, attempt))
            if waiter is not None:
                self._finish(waiter)
                self._metrics.cancelled.inc()

    async def _admit_safely(self, waiter: _Waiter, payload: bytes) -> None:
        try:
            await self._admit(waiter, payload)
        except Exception:  # noqa: BLE001 - answered as the encoder's fault, then retried elsewhere
            logger.exception("encoder: an item could not be handled")
            self._fail(waiter, "internal", "the encoder failed on this item")

    async def _admit(self, waiter: _Waiter, payload: bytes) -> None:
        item = waiter.item
        try:
            data = await self._media.read(item, payload)
            digest = content_digest(data)
            if digest != item.item.content_digest:
                raise ItemError(
                    "content_changed",
                    f"image item {item.item_index}: its bytes differ from the ones planned "
                    f"(digest {digest[:16]}, planned {item.item.content_digest[:16]}); the media "
                    "changed between the plan and the encode",
                )
        except ItemError as exc:
            self._fail(waiter, exc.code, exc.message)
            return
        if waiter.is_finished:  # cancelled while its bytes were read
            return
        key = content_key(item, digest)
        self._metrics.cache_queries.inc()
        hit = self._cache.get(key)
        if hit is not None:
            self._metrics.cache_hits.inc()
            self._answer(waiter, hit, cache_hit=True)
            return
        job = self._jobs.get(key)
        if job is not None:
            self._metrics.deduplicated.inc()
            job.waiters.append(waiter)
            return
        job = self._jobs[key] = _Job(key, [waiter])
        try:
            job.processed = await self._media.process(item, data)
        except ItemError as exc:
            self._end_job(job, error=(exc.code, exc.message))
            return
        except BaseException:
            self._end_job(job, error=("internal", "the encoder's CPU stage failed"))
            raise
        self._ready.append(job)
        self._wake.set()

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._ready:
                batch = self._take_batch()
                if not batch:
                    continue
                images = [job.processed for job in batch]
                encode = self._vision.encode
                try:
                    outs = await loop.run_in_executor(self._vision_pool, encode, images)
                except Exception:  # noqa: BLE001 - answered as the encoder's fault
                    logger.exception("encoder: the vision tower failed on a batch")
                    for job in batch:
                        self._end_job(job, error=("internal", "the encoder's vision tower failed"))
                    continue
                self._metrics.forward_calls.inc()
                self._metrics.items_encoded.inc(len(batch))
                for job, out in zip(batch, outs, strict=True):
                    self._cache.put(job.key, out, out.nbytes)
                    self._end_job(job, result=out)

    def _take_batch(self) -> list[_Job]:
        """Ready jobs in arrival order up to the patch budget (one larger job runs alone);
        jobs nobody waits for any more (cancelled) are dropped unencoded."""
        batch: list[_Job] = []
        num_patches = 0
        while self._ready:
            job = self._ready[0]
            if not job.has_waiters():
                self._ready.popleft()
                self._jobs.pop(job.key, None)
                continue
            assert job.processed is not None
            n = job.processed.num_patches
            if batch and num_patches + n > self._patch_budget:
                break
            batch.append(self._ready.popleft())
            num_patches += n
        return batch

    def _end_job(
        self,
        job: _Job,
        *,
        result: CachedEmbedding | None = None,
        error: tuple[str, str] | None = None,
    ) -> None:
        self._jobs.pop(job.key, None)
        for waiter in job.waiters:
            if waiter.is_finished:
                continue
            if result is not None:
                self._answer(waiter, result, cache_hit=False)
            else:
                assert error is not None
                self._fail(waiter, *error)

    def _answer(self, waiter: _Waiter, emb: CachedEmbedding, *, cache_hit: bool) -> None:
        self._finish(waiter)
        item = waiter.item
        result = EncodeResult(
            request_id=item.request_id,
            item_index=item.item_index,
            identifier=item.identifier,
            attempt=item.attempt,
            grid_thw=emb.grid_thw,
            dtype=emb.dtype,  # type: ignore[arg-type]
            shape=emb.shape,
            cache_hit=cache_hit,
        )
        self._metrics.sent_bytes.inc(emb.nbytes)
        self._send(waiter.client, result, emb.data)

    def _fail(self, waiter: _Waiter, code: str, message: str) -> None:
        if waiter.is_finished:
            return
        self._finish(waiter)
        self._metrics.item_errors.labels(code).inc()
        self._send(waiter.client, self._error_result(waiter.item, code, message))

    def _error_result(self, item: EncodeItem, code: str, message: str) -> EncodeResult:
        return EncodeResult(
            request_id=item.request_id,
            item_index=item.item_index,
            identifier=item.identifier,
            attempt=item.attempt,
            grid_thw=item.item.grid_thw,
            dtype=self._vision.dtype_name,  # type: ignore[arg-type]
            shape=(0, self._vision.embedding_width),
            error_code=code,
            error_message=message,
        )

    def _finish(self, waiter: _Waiter) -> None:
        """Take the waiter out of the queue (answered or cancelled), once."""
        if waiter.is_finished:
            return
        waiter.is_finished = True
        self.queued_patches -= waiter.num_patches
        if self._tickets.get(waiter.ticket) is waiter:
            del self._tickets[waiter.ticket]

    def _send(self, client: bytes, msg: Message, payload: bytes = b"") -> None:
        frames = encode_message(msg, payload, self._secret)
        with contextlib.suppress(zmq.ZMQError):  # the client is gone: nobody to answer
            sent = self._socket.send_multipart([client, *frames], copy=False)
            if isinstance(sent, asyncio.Future):
                sent.add_done_callback(_log_send_error)


def _log_send_error(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.warning("encoder: a reply could not be sent: %s", fut.exception())
