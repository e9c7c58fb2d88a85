"""ReplicaSet: N engine processes (data-parallel replicas) behind one front end, routed by content.

`LLMEngine` drives it as it drives one `CoreClient` (it is a `CoreLike`). Each request goes to
one replica, chosen by `mmserve.routing.route_by_content` on its routing key (its first item's
identity, or its prompt's first block of tokens for a text-only request) and the replicas'
loads (their unfinished requests), so a repeated picture meets the replica whose encoder cache
and prefix cache hold it. Every replica keeps its own `EngineMetrics` (its scheduler's stats
land there); the front end's `EngineMetrics` keeps the request metrics and counts
`dp_routed_requests` by reason ("affinity" or "load").

A replica that dies is passed over at once. Its requests that nothing has come back for yet are
sent again to a live replica (the client has seen nothing, so the answer is the same as if
they had gone there first); the others end with a 503 failure. It is restarted in the
background (`replica_restart.Restarts`) and rejoins when its model is loaded. While no replica
is live, new requests are refused with `NoReplicaAvailableError` (503) and the server stays up.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import blake3
import zmq

from mmserve.config.engine import EngineConfig
from mmserve.config.scheduler import CacheConfig, SchedulerConfig
from mmserve.engine.frontend.core_client import STEP_POLL_MS, CoreClient
from mmserve.engine.frontend.replica_restart import Restarts, start_replicas
from mmserve.engine.frontend.wakeup import Wakeup
from mmserve.errors import EngineDeadError, FailureKind, NoReplicaAvailableError, RequestFailure
from mmserve.metrics import EngineMetrics
from mmserve.multimodal import ProcessedPrompt
from mmserve.routing import route_by_content
from mmserve.sampling_params import SamplingParams
from mmserve.updates import RequestStatus, RequestUpdate

logger = logging.getLogger(__name__)

# How many routing keys each replica remembers having been sent (its caches probably hold
# them): a detour makes a key's second replica a holder too, so the key can then go to either.
RECENT_KEYS_PER_REPLICA = 4096


@dataclass(slots=True)
class Replica:
    """One engine process of the set; `client` is None while it is down (being restarted)."""

    index: int
    device: str  # where it runs, as the start-up log and /health say it
    client: CoreClient | None
    dead_reason: str | None = None
    num_requests: int = 0  # requests routed to it since the server started
    recent_keys: OrderedDict[str, None] = field(default_factory=OrderedDict)

    @property
    def name(self) -> str:
        return f"replica-{self.index}"

    def remember(self, key: str) -> None:
        self.recent_keys[key] = None
        self.recent_keys.move_to_end(key)
        if len(self.recent_keys) > RECENT_KEYS_PER_REPLICA:
            self.recent_keys.popitem(last=False)


class ReplicaState(NamedTuple):
    """What /health says of one replica."""

    index: int
    device: str
    is_live: bool
    dead_reason: str | None
    num_requests: int  # routed to it since the server started (restarts included)


class _Sent(NamedTuple):
    """A request nothing has come back for yet: what it takes to send it again."""

    prompt: ProcessedPrompt
    params: SamplingParams
    cache_salt: str | None


class ReplicaSet:
    """`CoreLike` over data-parallel replicas. One thread drives it (the engine loop's)."""

    def __init__(
        self,
        replicas: list[Replica],
        replica_metrics: list[EngineMetrics],
        *,
        front_metrics: EngineMetrics,
        restarts: Restarts,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        load_slack: float,
    ) -> None:
        self.replicas = replicas
        # replica i's metrics, kept across its restarts (`EngineMetrics.reset_source` keeps its
        # counters monotonic); the front end's metrics read them as `front_metrics.replicas`
        self.replica_metrics = replica_metrics
        self.front_metrics = front_metrics
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.dead_reason: str | None = None  # the set lives on while any replica can come back
        self._restarts = restarts
        self._load_slack = load_slack
        self._owner: dict[str, int] = {}  # request id -> replica index
        self._unanswered: dict[str, _Sent] = {}
        self._backlog: list[RequestUpdate] = []  # failures of a lost replica, not yet stepped
        self._wakeup = Wakeup()

    @classmethod
    def start(cls, config: EngineConfig, front_metrics: EngineMetrics, max_model_len: int):
        """Start `config.parallel.data_parallel_size` engine processes and wait for all."""
        started = start_replicas(config, max_model_len)
        replicas = [Replica(s.index, s.device, s.client) for s in started]
        front_metrics.replicas = [s.metrics for s in started]
        # Admission must hold on every replica: the one with the fewest KV blocks decides.
        smallest = min(started, key=lambda s: s.client.cache_config.num_blocks or 0)
        restarts = Restarts(config)
        replica_set = cls(
            replicas,
            list(front_metrics.replicas),
            front_metrics=front_metrics,
            restarts=restarts,
            scheduler_config=smallest.client.scheduler_config,
            cache_config=smallest.client.cache_config,
            load_slack=config.parallel.data_parallel_load_slack,
        )
        return replica_set, started[0].resolved

    # ------------------------------------------------------------------------------ CoreLike

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> None:
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self._send(request_id, _Sent(prompt, params, cache_salt))

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            self._unanswered.pop(request_id, None)
            index = self._owner.pop(request_id, None)
            if index is not None:
                by_replica.setdefault(index, []).append(request_id)
        for index, ids in by_replica.items():
            client = self.replicas[index].client
            if client is not None:
                client.finish_requests(ids, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner or self._backlog)

    def step(self) -> list[RequestUpdate]:
        """The updates every live replica finished since the last call (and the failures of
        the requests a lost replica took with it); waits up to STEP_POLL_MS for any."""
        self._adopt_restarted()
        updates, self._backlog = self._backlog, []
        live = self._live()
        if not updates and live:
            poller = zmq.Poller()
            poller.register(self._wakeup.fd, zmq.POLLIN)
            for replica in live:
                assert replica.client is not None
                poller.register(replica.client.outputs_socket, zmq.POLLIN)
            if self._wakeup.fd in dict(poller.poll(STEP_POLL_MS)):
                self._wakeup.clear()
        for replica in live:
            assert replica.client is not None
            try:
                got = replica.client.step(poll_ms=0)
            except EngineDeadError as exc:
                updates.extend(self._lose(replica, exc.reason))
                continue
            for update in got:
                self._unanswered.pop(update.request_id, None)
                if update.finished:
                    self._owner.pop(update.request_id, None)
            updates.extend(got)
        return updates

    def wake(self) -> None:
        """From any thread: end a `step` waiting for outputs (a request is ready to be sent)."""
        self._wakeup.set()

    def check_alive(self) -> None:
        """Notice replicas that died (their requests' failures come with the next step) and
        take in those that restarted. Never raises: the set is not dead while any replica
        can come back."""
        self._adopt_restarted()
        for replica in self._live():
            assert replica.client is not None
            try:
                replica.client.check_alive()
            except EngineDeadError as exc:
                self._backlog.extend(self._lose(replica, exc.reason))

    def shutdown(self) -> None:
        self._restarts.stop()
        for replica in self.replicas:
            if replica.client is not None:
                replica.client.shutdown()
                replica.client = None
        self._wakeup.close()

    # ---------------------------------------------------------------------------- routing

    def states(self) -> list[ReplicaState]:
        """Each replica's state, for /health (read from any thread)."""
        return [
            ReplicaState(r.index, r.device, r.client is not None, r.dead_reason, r.num_requests)
            for r in self.replicas
        ]

    def owner(self, request_id: str) -> int | None:
        """The replica a request runs on (None once it finished)."""
        return self._owner.get(request_id)

    def _live(self) -> list[Replica]:
        return [r for r in self.replicas if r.client is not None]

    def _send(self, request_id: str, sent: _Sent) -> None:
        key = routing_key(sent.prompt, sent.cache_salt, self.cache_config.block_size)
        while True:
            live = self._live()
            if not live:
                raise NoReplicaAvailableError(
                    f"all {len(self.replicas)} engine replicas are down and restarting; "
                    "retry in a few seconds"
                )
            route = route_by_content(
                key,
                [r.name for r in live],
                [r.client.num_unfinished_requests for r in live if r.client is not None],
                [key in r.recent_keys for r in live],
                load_slack=self._load_slack,
            )
            assert route is not None
            replica = live[route.index]
            assert replica.client is not None
            try:
                replica.client.add_request(
                    request_id, sent.prompt, sent.params, cache_salt=sent.cache_salt
                )
            except EngineDeadError as exc:  # died since the last step: route again
                self._backlog.extend(self._lose(replica, exc.reason))
                continue
            break
        self._owner[request_id] = replica.index
        self._unanswered[request_id] = sent
        replica.remember(key)
        replica.num_requests += 1
        reason = "affinity" if route.by_affinity else "load"
        self.front_metrics.inc_labelled("dp_routed_requests", reason)

    def _lose(self, replica: Replica, reason: str) -> list[RequestUpdate]:
        """Take a dead replica out of routing, send its unanswered requests elsewhere, fail
        the rest, and start restarting it."""
        assert replica.client is not None
        replica.client.shutdown()  # the process is gone or broken: release its sockets
        replica.client = None
        replica.dead_reason = reason
        replica.recent_keys.clear()  # a restarted replica starts with empty caches
        self.replica_metrics[replica.index].reset_source()  # its gauges read 0 until it is back
        lost = [i for i, owner in self._owner.items() if owner == replica.index]
        retried, failed = 0, []
        for request_id in lost:
            del self._owner[request_id]
            sent = self._unanswered.pop(request_id, None)
            if sent is not None and self._live():
                try:
                    self._send(request_id, sent)
                    retried += 1
                    continue
                except NoReplicaAvailableError:
                    pass
            failure = RequestFailure(
                f"engine replica {replica.index} stopped while running this request; retry it",
                FailureKind.UNAVAILABLE,
            )
            failed.append(
                RequestUpdate(request_id, [], RequestStatus.FINISHED_ERROR, error=failure)
            )
        logger.error(
            "replica %d (%s) is down: %s; %d of its requests sent to another replica, %d failed; "
            "%d of %d replicas live; restarting it",
            replica.index,
            replica.device,
            reason,
            retried,
            len(failed),
            len(self._live()),
            len(self.replicas),
        )
        self._restarts.begin(replica.index, self.replica_metrics[replica.index])
        return failed

    def _adopt_restarted(self) -> None:
        for started in self._restarts.ready():
            replica = self.replicas[started.index]
            if replica.client is not None:  # cannot happen: only a lost replica restarts
                started.client.shutdown()
                continue
            replica.client = started.client
            replica.dead_reason = None
            logger.info(
                "replica %d (%s) rejoined; %d of %d replicas live",
                replica.index,
                replica.device,
                len(self._live()),
                len(self.replicas),
            )


def routing_key(prompt: ProcessedPrompt, cache_salt: str | None, block_size: int) -> str:
    """What a request is routed by: its first item's identity (the encoder-cache key), or for
    a text-only prompt a digest of its first block of tokens and its cache salt (what its
    first prefix-cache block is keyed by)."""
    if prompt.mm_features:
        return "item:" + prompt.mm_features[0].identifier
    head = ",".join(map(str, prompt.prompt_token_ids[:block_size]))
    digest = blake3.blake3(head.encode())
    if cache_salt is not None:
        digest.update(b"\x00salt:" + cache_salt.encode())
    return "text:" + digest.hexdigest()
