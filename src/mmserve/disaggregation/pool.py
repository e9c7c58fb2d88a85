"""The language-model side's client of the `mmserve encode` pool: an EncoderSource over ZMQ.

The runner calls `submit`, `cancel`, `poll` and `wait` from the engine's thread; none of them
touches the network. A command is queued for the pool's I/O thread (`pool_io.PoolIO`, which
owns the sockets) and a wake-up frame sent on an inproc PAIR. Results come back through a
locked outbox. An item nobody could encode remotely goes to the fallback: with `local`, its
CPU stage runs on the pool's own worker thread (`local_fallback.LocalFallback`) and the runner
gets its pixels to encode here; with `fail`, the item fails with a 503-kind failure.

The engine side keeps the authority over what is live: an identifier maps to the submission
that made it live, and a result is delivered only if that submission is still live. So a
reply racing a cancel, or a fallback finishing after one, is dropped here whatever the I/O
thread knew.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import zmq

from mmserve.config.pool import (
    DEFAULT_ENCODER_FALLBACK,
    DEFAULT_ENCODER_TIMEOUT_S,
    ENCODER_FALLBACKS,
)
from mmserve.disaggregation.discovery import (
    EncoderEndpoint,
    ModelIdentity,
    discover,
    normalise_encoder_url,
)
from mmserve.disaggregation.local_fallback import LocalFallback
from mmserve.disaggregation.pool_io import PoolIO
from mmserve.disaggregation.pool_state import IOConfig, PendingItem
from mmserve.errors import FailureKind, InvalidRequestError, MMServeError, RequestFailure
from mmserve.execution.encoder.source import EncoderArrival, EncoderItemFailure
from mmserve.metrics import EngineMetrics
from mmserve.multimodal import MultiModalFeature, RemoteItem

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolConfig:
    """How the pool is reached and how hard it tries (`mmserve serve --encoder-*`)."""

    encoder_urls: tuple[str, ...]
    identity: ModelIdentity
    fallback: str = DEFAULT_ENCODER_FALLBACK
    timeout_s: float = DEFAULT_ENCODER_TIMEOUT_S  # one attempt on one encoder
    secret: bytes | None = None
    discovery_timeout_s: float = 30.0
    ping_interval_s: float = 0.5
    # a healthy encoder that leaves a ping unanswered for missed_pings x ping_interval_s leaves
    # rotation (counted from the ping: a pause of this server's own is not the encoder's
    # silence); an encoder answers pings from its I/O loop, also while it encodes
    missed_pings: int = 6
    send_hwm: int = 1024

    def __post_init__(self) -> None:
        if not self.encoder_urls:
            raise ValueError("--encoder-urls needs at least one http://host:port")
        urls = tuple(normalise_encoder_url(u) for u in self.encoder_urls)
        if len(set(urls)) != len(urls):
            raise ValueError(f"--encoder-urls names an encoder twice: {list(urls)}")
        object.__setattr__(self, "encoder_urls", urls)
        if self.fallback not in ENCODER_FALLBACKS:
            raise ValueError(
                f"--encoder-fallback must be one of {ENCODER_FALLBACKS}, got {self.fallback!r}"
            )
        for name in ("timeout_s", "discovery_timeout_s", "ping_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PoolConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.missed_pings < 1 or self.send_hwm < 1:
            raise ValueError("PoolConfig.missed_pings and send_hwm must be >= 1")
        if self.secret is not None and not self.secret:
            raise ValueError("the encoder secret is empty; give a non-empty one or none")


class RemoteEncoderPool:
    """EncoderSource over a pool of `mmserve encode` servers (see the module docstring)."""

    def __init__(
        self,
        config: PoolConfig,
        endpoints: Sequence[EncoderEndpoint],
        *,
        metrics: EngineMetrics,
        local_fallback: LocalFallback | None = None,
    ) -> None:
        """`endpoints`: the discovered encoders (`start` discovers them); `local_fallback`:
        required with fallback "local"."""
        if config.fallback == "local" and local_fallback is None:
            raise ValueError("--encoder-fallback local needs the local CPU stage")
        self.config = config
        self.metrics = metrics
        self._local = local_fallback
        self._lock = threading.Condition()
        # identifier -> (submission number, request id): what the engine still waits for
        self._live: dict[str, tuple[int, str]] = {}
        self._live_per_request: Counter[str] = Counter()
        self._items_sent: Counter[str] = Counter()  # item ordinals per request with live items
        self._arrivals: list[EncoderArrival] = []
        self._failures: list[EncoderItemFailure] = []
        self._submissions = itertools.count(1)
        self._io_failure: str | None = None  # set when the I/O thread has died
        self._ctx = zmq.Context()
        wake_address = f"inproc://mmserve-encoder-pool-{id(self)}"
        io_config = IOConfig(
            identity=config.identity,
            timeout_s=config.timeout_s,
            secret=config.secret,
            ping_interval_s=config.ping_interval_s,
            missed_pings=config.missed_pings,
            send_hwm=config.send_hwm,
        )
        self._io = PoolIO(self._ctx, endpoints, io_config, self, metrics, wake_address)
        self._wake = self._ctx.socket(zmq.PAIR)
        self._wake.setsockopt(zmq.LINGER, 0)
        self._wake.connect(wake_address)
        self._wake_lock = threading.Lock()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="mmserve-pool-fallback")
        self._thread = threading.Thread(target=self._io.run, name="mmserve-pool-io", daemon=True)
        self._thread.start()
        self._is_shut_down = False

    @classmethod
    def start(
        cls,
        config: PoolConfig,
        *,
        metrics: EngineMetrics,
        local_fallback: LocalFallback | None = None,
    ) -> RemoteEncoderPool:
        """Discover every encoder (ValueError naming the one that does not fit), then start.
        All of them share one discovery window of `discovery_timeout_s`."""
        deadline = time.monotonic() + config.discovery_timeout_s
        endpoints = []
        for url in config.encoder_urls:
            endpoints.append(
                discover(
                    url,
                    config.identity,
                    secret=config.secret,
                    timeout_s=max(0.5, deadline - time.monotonic()),
                )
            )
        logger.info("encoder pool: %s", ", ".join(ep.url for ep in endpoints))
        return cls(config, endpoints, metrics=metrics, local_fallback=local_fallback)

    # ------------------------------------------------------------ EncoderSource

    def submit(self, request_id: str, feature: MultiModalFeature, item: RemoteItem) -> None:
        if not isinstance(item, RemoteItem):
            raise TypeError(f"the encoder pool encodes RemoteItems, got {type(item)}")
        with self._lock:
            if feature.identifier in self._live:
                return
            submission = next(self._submissions)
            self._live[feature.identifier] = (submission, request_id)
            self._live_per_request[request_id] += 1
            item_index = self._items_sent[request_id]
            self._items_sent[request_id] += 1
            p = PendingItem(request_id, item_index, feature, item, submission)
            if self._io_failure is not None:
                self._fail_locked(p, RequestFailure(self._io_failure, FailureKind.INTERNAL))
                return
        self._post("submit", p)

    def cancel(self, identifiers: Iterable[str]) -> None:
        gone = set(identifiers)
        cancelled = []
        with self._lock:
            for identifier in gone:
                if identifier in self._live:
                    self._forget(identifier)
                    cancelled.append(identifier)
            # NOTE: one that finished but was not polled yet is dropped too: nobody takes it
            self._arrivals = [a for a in self._arrivals if a.identifier not in gone]
            self._failures = [f for f in self._failures if f.identifier not in gone]
        if cancelled:
            self._post("cancel", tuple(cancelled))

    def poll(self) -> tuple[list[EncoderArrival], list[EncoderItemFailure]]:
        with self._lock:
            arrivals, self._arrivals = self._arrivals, []
            failures, self._failures = self._failures, []
        return arrivals, failures

    def wait(self, timeout_s: float) -> None:
        with self._lock:
            self._lock.wait_for(lambda: self._arrivals or self._failures, timeout=timeout_s)

    def num_pending(self) -> int:
        with self._lock:
            return len(self._live)

    def shutdown(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self._post("stop", None)
        self._thread.join(timeout=5.0)
        self._worker.shutdown(wait=False, cancel_futures=True)
        with self._wake_lock:
            self._wake.close(linger=0)
        self._ctx.term()
        if self._local is not None:
            self._local.close()

    # ------------------------------------------------------------ PoolSink (I/O thread)

    def arrived(self, p: PendingItem, embeddings: torch.Tensor, encoder: str) -> None:
        arrival = EncoderArrival(p.feature.identifier, embeddings=embeddings, encoder=encoder)
        self._deliver(p, arrival=arrival)

    def failed(self, p: PendingItem, failure: RequestFailure) -> None:
        self._deliver(p, failure=EncoderItemFailure(p.feature.identifier, failure))

    def fallback(self, p: PendingItem) -> None:
        """No encoder could encode p: encode it here, or fail it (503)."""
        reason = p.last_error or "no encoder of the pool is in rotation"
        if self.config.fallback == "fail" or self._local is None:
            message = f"no encoder could encode {p.describe()}: {reason}"
            self.failed(p, RequestFailure(message, FailureKind.UNAVAILABLE))
            return
        logger.info("%s: encoding it here (%s)", p.describe(), reason)
        self.metrics.inc("remote_encoder_fallbacks")
        self._worker.submit(self._run_local, p)

    def io_failed(self, reason: str) -> None:
        with self._lock:
            self._io_failure = reason
            for identifier in list(self._live):
                self._failures.append(
                    EncoderItemFailure(identifier, RequestFailure(reason, FailureKind.INTERNAL))
                )
                self._forget(identifier)
            self._lock.notify_all()

    # ------------------------------------------------------------ internals

    def _fail_locked(self, p: PendingItem, failure: RequestFailure) -> None:
        self._forget(p.feature.identifier)
        self._failures.append(EncoderItemFailure(p.feature.identifier, failure))
        self._lock.notify_all()

    def _run_local(self, p: PendingItem) -> None:
        assert self._local is not None
        with self._lock:
            if self._live.get(p.feature.identifier, (0,))[0] != p.generation:
                return  # cancelled while it waited for the worker
        try:
            pixels = self._local.process(p.item)
        except InvalidRequestError as exc:
            message = f"{p.describe()}: {exc.message}"
            failure = RequestFailure(message, FailureKind.REQUEST, exc.param)
        except MMServeError as exc:  # busy decode or fetch slots: the server, not the input
            failure = RequestFailure(f"{p.describe()}: {exc}", FailureKind.UNAVAILABLE)
        except Exception:  # noqa: BLE001 - a bug met by this item: its requests fail alone
            logger.exception("%s: the local fallback failed", p.describe())
            failure = RequestFailure(
                f"{p.describe()}: the local CPU stage failed", FailureKind.INTERNAL
            )
        else:
            arrival = EncoderArrival(p.feature.identifier, pixels=pixels, encoder="local")
            self._deliver(p, arrival=arrival)
            return
        self.failed(p, failure)

    def _deliver(
        self,
        p: PendingItem,
        *,
        arrival: EncoderArrival | None = None,
        failure: EncoderItemFailure | None = None,
    ) -> None:
        with self._lock:
            if self._live.get(p.feature.identifier, (0,))[0] != p.generation:
                return  # cancelled (or cancelled and submitted again) meanwhile
            self._forget(p.feature.identifier)
            if arrival is not None:
                self._arrivals.append(arrival)
            if failure is not None:
                self._failures.append(failure)
            self._lock.notify_all()

    def _forget(self, identifier: str) -> None:
        """Drop a live identifier (the lock is held)."""
        _, request_id = self._live.pop(identifier)
        self._live_per_request[request_id] -= 1
        if self._live_per_request[request_id] == 0:
            del self._live_per_request[request_id]
            del self._items_sent[request_id]

    def _post(self, kind: str, arg: object) -> None:
        self._io.commands.append((kind, arg))
        with self._wake_lock:
            if not self._wake.closed:
                with contextlib.suppress(zmq.Again):  # wake-ups queued already: it will look
                    self._wake.send(b"", zmq.NOBLOCK)
