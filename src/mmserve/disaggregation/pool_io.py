"""The encoder pool's I/O thread: one DEALER per encoder, fan-out, deadlines, health, retries.

Everything here runs on the one thread that owns the sockets (ZMQ sockets are not thread-safe).
The engine's thread talks to it only through `PoolIO.post` (a command queue plus a wake-up
frame on an inproc PAIR), and it answers through the `PoolSink` it was given.

An item's life (attempt numbers are unique across the pool, so a reply names exactly one send):

    submit -> choose encoder -> send (attempt a) -> result a       -> sink.arrived / failed
                                               \\-> error/timeout  -> next encoder (attempt b)
                                                                 \\-> none left: sink.fallback
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

import torch
import zmq

from mmserve.disaggregation.discovery import EncoderEndpoint
from mmserve.disaggregation.embedding_dtypes import TORCH_DTYPES
from mmserve.disaggregation.pool_state import (
    EncoderLink,
    IOConfig,
    PendingItem,
    PoolSink,
    rejoin_backoff_s,
)
from mmserve.disaggregation.protocol import (
    Cancel,
    EncodeResult,
    MalformedMessage,
    Ping,
    Pong,
    check_result_payload,
    decode_message,
    encode_message,
    is_input_error,
)
from mmserve.errors import FailureKind, RequestFailure
from mmserve.metrics import EngineMetrics
from mmserve.routing import choose_bounded

logger = logging.getLogger(__name__)

# Encoder error codes that take the encoder out of rotation ("overloaded" only moves the item).
_OUT_OF_ROTATION_CODES = ("internal", "shutting_down")
_RECENT_ATTEMPTS = 8192  # finished attempts remembered to name why a late reply is dropped


class PoolIO:
    """The sockets and the pending table; `run` is the thread's body."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoints: Sequence[EncoderEndpoint],
        config: IOConfig,
        sink: PoolSink,
        metrics: EngineMetrics,
        wake_address: str,
    ) -> None:
        self.config = config
        self.sink = sink
        self.metrics = metrics
        self.poller = zmq.Poller()
        self.wake = ctx.socket(zmq.PAIR)
        self.wake.bind(wake_address)
        self.poller.register(self.wake, zmq.POLLIN)
        now = time.monotonic()
        self.links: list[EncoderLink] = []
        for ep in endpoints:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, config.send_hwm)
            sock.setsockopt(zmq.RCVHWM, config.send_hwm)
            sock.connect(ep.zmq_address)
            self.poller.register(sock, zmq.POLLIN)
            self.links.append(EncoderLink(ep.url, sock, last_pong_s=now))
        self.by_socket = {link.socket: link for link in self.links}
        self.commands: deque[tuple[str, object]] = deque()  # appended by the engine's thread
        self.pending: dict[str, PendingItem] = {}
        self.recent: OrderedDict[int, tuple[str, str]] = OrderedDict()  # attempt -> (id, why)
        self.attempts = itertools.count(1)
        self.is_stopping = False
        self._set_healthy_gauge()

    # ---------------------------------------------------------------- the loop

    def run(self) -> None:
        try:
            while not self.is_stopping:
                for sock, _ in self.poller.poll(self._poll_timeout_ms()):
                    if sock is self.wake:
                        self._drain_wake()
                    else:
                        self._receive(self.by_socket[sock])
                self._run_commands()
                now = time.monotonic()
                self._check_deadlines(now)
                self._ping(now)
        except Exception as exc:  # noqa: BLE001 - a bug here must not leave items waiting
            logger.exception("the encoder pool's I/O thread failed")
            self.sink.io_failed(f"{type(exc).__name__} in the encoder pool's I/O thread")
        finally:
            for link in self.links:
                link.socket.close(linger=0)
            self.wake.close(linger=0)

    def _poll_timeout_ms(self) -> int:
        now = time.monotonic()
        wake_at = min(link.next_ping_s for link in self.links) if self.links else now + 1.0
        for p in self.pending.values():
            wake_at = min(wake_at, p.deadline_s)
        return max(0, math.ceil((wake_at - now) * 1000))

    def _drain_wake(self) -> None:
        while True:
            try:
                self.wake.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _run_commands(self) -> None:
        while self.commands:
            kind, arg = self.commands.popleft()
            if kind == "submit":
                assert isinstance(arg, PendingItem)
                self._submit(arg)
            elif kind == "cancel":
                assert isinstance(arg, tuple)
                self._cancel(arg)
            else:
                assert kind == "stop", kind
                self.is_stopping = True

    # ---------------------------------------------------------------- sending

    def _submit(self, p: PendingItem) -> None:
        old = self.pending.pop(p.feature.identifier, None)
        if old is not None:  # resubmitted after a cancel this thread has not seen yet
            self._release(old, "cancelled")
        try:
            encode_message(p.message())  # a header over the limit (a huge URL) never goes
        except ValueError as exc:
            failure = RequestFailure(f"{p.describe()}: {exc}", FailureKind.REQUEST, "image_url")
            self.sink.failed(p, failure)
            return
        self.pending[p.feature.identifier] = p
        self._dispatch(p, time.monotonic(), is_retry=False)

    def _choose(self, p: PendingItem) -> EncoderLink | None:
        """The healthy, untried encoder ranked first for p's identity (rendezvous hashing), so
        that every language server sends one picture to the encoder that has cached it, unless
        that encoder carries more than its share of the input patches in flight."""
        candidates = [ln for ln in self.links if ln.is_healthy and ln.url not in p.tried]
        chosen = choose_bounded(
            p.feature.identifier,
            [ln.url for ln in candidates],
            [ln.load for ln in candidates],
            p.item.num_patches,
        )
        return None if chosen is None else candidates[chosen]

    def _dispatch(self, p: PendingItem, now: float, *, is_retry: bool) -> None:
        while (link := self._choose(p)) is not None:
            if is_retry:
                self.metrics.inc("remote_encoder_retries")
            if self._send(p, link, now):
                return
            is_retry = True
        del self.pending[p.feature.identifier]
        self.sink.fallback(p)

    def _send(self, p: PendingItem, link: EncoderLink, now: float) -> bool:
        item = p.item
        p.attempt = next(self.attempts)
        p.tried.add(link.url)
        frames = encode_message(p.message(), secret=self.config.secret)
        try:
            link.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            p.last_error = f"encoder {link.url} has {self.config.send_hwm} messages queued"
            return False
        p.encoder, p.sent_at_s = link, now
        p.deadline_s = now + self.config.timeout_s
        link.outstanding_patches += item.num_patches
        self.metrics.inc_labelled("embedding_transfer_bytes", "sent", item.nbytes)
        return True

    def _release(self, p: PendingItem, why: str) -> None:
        """Forget p's current attempt (its late reply is dropped as `why`)."""
        if p.encoder is not None:
            p.encoder.outstanding_patches -= p.item.num_patches
            p.encoder = None
        p.deadline_s = math.inf
        self.recent[p.attempt] = (p.feature.identifier, why)
        while len(self.recent) > _RECENT_ATTEMPTS:
            self.recent.popitem(last=False)

    def _retry(self, p: PendingItem, reason: str) -> None:
        logger.info("%s: %s; trying another encoder", p.describe(), reason)
        self._release(p, "stale")
        p.last_error = reason
        self._dispatch(p, time.monotonic(), is_retry=True)

    def _cancel(self, identifiers: tuple[str, ...]) -> None:
        by_link: dict[str, tuple[EncoderLink, list[PendingItem]]] = {}
        for identifier in identifiers:
            p = self.pending.pop(identifier, None)
            if p is None:
                continue
            if p.encoder is not None:
                by_link.setdefault(p.encoder.url, (p.encoder, []))[1].append(p)
        for link, items in by_link.values():
            self._cancel_on(link, items)
        for _, items in by_link.values():
            for p in items:
                self._release(p, "cancelled")

    def _cancel_on(self, link: EncoderLink, items: list[PendingItem]) -> None:
        """Tell `link` nobody waits for these attempts (its queue may drop them)."""
        ids = [p.feature.identifier for p in items]
        self._send_control(link, Cancel(ids, [p.attempt for p in items]))

    def _send_control(self, link: EncoderLink, msg: Cancel | Ping) -> None:
        # A full queue loses the message: a lost Cancel wastes work there (its reply is
        # dropped here), a lost Ping counts as unanswered.
        with contextlib.suppress(zmq.Again):
            link.socket.send_multipart(
                encode_message(msg, b"", self.config.secret), flags=zmq.NOBLOCK
            )

    # ---------------------------------------------------------------- receiving

    def _receive(self, link: EncoderLink) -> None:
        while True:
            try:
                frames = link.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg, payload = decode_message([f.buffer for f in frames], self.config.secret)
            except MalformedMessage as exc:
                self._drop(exc.reason, link)
                continue
            if isinstance(msg, Pong):
                self._on_pong(link, msg)
            elif isinstance(msg, EncodeResult):
                self._on_result(link, msg, payload)
            else:
                self._drop("unexpected_kind", link)

    def _drop(self, reason: str, link: EncoderLink) -> None:
        logger.debug("dropped a message from encoder %s: %s", link.url, reason)
        self.metrics.inc_labelled("remote_encoder_dropped_messages", reason)

    def _on_result(self, link: EncoderLink, msg: EncodeResult, payload: memoryview) -> None:
        p = self.pending.get(msg.identifier)
        if p is None or p.attempt != msg.attempt:
            known = self.recent.get(msg.attempt)
            why = known[1] if known is not None and known[0] == msg.identifier else "unknown"
            self._drop("duplicate" if why == "done" else why, link)
            return
        if p.encoder is not link:
            self._drop("wrong_encoder", link)
            return
        if msg.error_code is not None:
            self._on_error(link, p, msg)
            return
        problem = check_result_payload(
            msg,
            len(payload),
            expected_grid=p.item.grid_thw,
            expected_num_embeds=p.feature.num_embeds,
            expected_width=self.config.identity.embedding_width,
        )
        if problem is not None:
            self._drop("bad_payload", link)
            self._take_out(link, f"encoder {link.url} answered {p.describe()} with {problem}")
            return
        # [num_embeds, embedding_width], copied out of the ZMQ frame (reused once we return)
        embeddings = torch.frombuffer(bytearray(payload), dtype=TORCH_DTYPES[msg.dtype])
        embeddings = embeddings.reshape(msg.shape)
        latency_s = time.monotonic() - p.sent_at_s
        link.strikes = 0  # it encodes again: a later fault starts the backoff afresh
        self._release(p, "done")
        del self.pending[msg.identifier]
        self.metrics.inc_labelled("embedding_transfer_bytes", "received", len(payload))
        self.metrics.inc_labelled("remote_encoder_items", link.url)
        self.metrics.inc_labelled("remote_encoder_latency_seconds", link.url, latency_s)
        self.sink.arrived(p, embeddings, link.url)

    def _on_error(self, link: EncoderLink, p: PendingItem, msg: EncodeResult) -> None:
        code = msg.error_code
        assert code is not None
        text = msg.error_message or code
        if is_input_error(code):
            self._release(p, "done")
            del self.pending[p.feature.identifier]
            self.sink.failed(
                p, RequestFailure(f"{p.describe()}: {text}", FailureKind.REQUEST, "image_url")
            )
        elif code in _OUT_OF_ROTATION_CODES:
            self._take_out(link, f"encoder {link.url} failed {p.describe()} ({code}: {text})")
        else:
            self._retry(p, f"encoder {link.url} refused it ({code}: {text})")

    # ---------------------------------------------------------------- health

    def _take_out(self, link: EncoderLink, reason: str) -> None:
        """Out of rotation until it answers a ping; its items go to the other encoders."""
        if link.is_healthy:
            link.strikes += 1
            backoff_s = rejoin_backoff_s(link.strikes, self.config.ping_interval_s)
            link.rejoin_not_before_s = time.monotonic() + backoff_s
            logger.warning(
                "%s: out of rotation until it answers pings (not before %.1f s)",
                reason,
                backoff_s,
            )
        link.is_healthy = False
        link.rejoin_after_nonce = link.ping_nonce
        self._set_healthy_gauge()
        moved = [p for p in self.pending.values() if p.encoder is link]
        if moved:
            self._cancel_on(link, moved)
        for p in moved:
            self._retry(p, reason)

    def _check_deadlines(self, now: float) -> None:
        for p in [p for p in self.pending.values() if p.deadline_s <= now]:
            if p.feature.identifier in self.pending and p.encoder is not None:
                link = p.encoder
                self._take_out(
                    link,
                    f"encoder {link.url} did not answer {p.describe()} within "
                    f"{self.config.timeout_s:g} s",
                )

    def _ping(self, now: float) -> None:
        # Silence is counted from a ping that went out: a pause of this thread (a loaded
        # machine) sends no pings, and is never taken for the encoder's silence.
        silent_s = self.config.missed_pings * self.config.ping_interval_s
        for link in self.links:
            since = link.unanswered_since_s
            if link.is_healthy and since is not None and now - since > silent_s:
                self._take_out(link, f"encoder {link.url} missed {self.config.missed_pings} pings")
            if now < link.next_ping_s:
                continue
            link.ping_nonce += 1
            link.next_ping_s = now + self.config.ping_interval_s
            if link.unanswered_since_s is None:
                link.unanswered_since_s = now
            self._send_control(link, Ping(link.ping_nonce))

    def _on_pong(self, link: EncoderLink, pong: Pong) -> None:
        if not 0 < pong.nonce <= link.ping_nonce:
            self._drop("unknown", link)
            return
        if pong.model_fingerprint != self.config.identity.fingerprint:
            self._drop("wrong_model", link)
            if link.is_healthy:
                self._take_out(link, f"encoder {link.url} now serves another checkpoint")
            return
        link.last_pong_s = time.monotonic()
        link.unanswered_since_s = None
        link.queued_patches = pong.queued_patches
        if (
            not link.is_healthy
            and pong.nonce > link.rejoin_after_nonce
            and link.last_pong_s >= link.rejoin_not_before_s
        ):
            logger.info("encoder %s answers pings again: back in rotation", link.url)
            link.is_healthy = True
            self._set_healthy_gauge()

    def _set_healthy_gauge(self) -> None:
        self.metrics.set_gauge("remote_encoder_healthy", sum(ln.is_healthy for ln in self.links))
