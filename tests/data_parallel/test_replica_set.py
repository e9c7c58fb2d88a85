"""ReplicaSet over small in-memory cores: routing, a lost replica's requests (sent again or
failed), no replica live, and a restarted replica rejoining. No engine processes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pytest
import zmq

from mmserve.config.scheduler import CacheConfig, SchedulerConfig
from mmserve.engine.frontend.replica_restart import StartedReplica
from mmserve.engine.frontend.replicas import Replica, ReplicaSet
from mmserve.errors import EngineDeadError, FailureKind, NoReplicaAvailableError
from mmserve.metrics import EngineMetrics
from mmserve.multimodal import ProcessedPrompt
from mmserve.sampling_params import SamplingParams
from mmserve.updates import RequestStatus, RequestUpdate

PARAMS = SamplingParams(max_tokens=4)


class Core:
    """What ReplicaSet asks of a replica's client, in memory; `die` is its process exiting."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.outputs_socket = ctx.socket(zmq.PULL)
        self.unfinished: set[str] = set()
        self.added: list[str] = []
        self.pending: list[RequestUpdate] = []
        self.dead_reason: str | None = None
        self.is_shut_down = False
        self.scheduler_config = SchedulerConfig(max_model_len=64, max_num_batched_tokens=64)
        self.cache_config = CacheConfig(block_size=16, num_blocks=8)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.unfinished)

    def add_request(self, request_id: str, prompt, params, *, cache_salt=None) -> None:
        self.check_alive()
        self.unfinished.add(request_id)
        self.added.append(request_id)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        self.unfinished.difference_update(request_ids)

    def step(self, poll_ms: int = 0) -> list[RequestUpdate]:
        self.check_alive()
        out, self.pending = self.pending, []
        return out

    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def shutdown(self) -> None:
        self.is_shut_down = True
        self.outputs_socket.close(linger=0)

    def answer(self, request_id: str, *, finished: bool = False) -> None:
        status = RequestStatus.FINISHED_LENGTH if finished else None
        self.pending.append(RequestUpdate(request_id, [7], status))


class Restarts:
    """Records which replicas ReplicaSet asked to restart; `ready` hands back what a test put."""

    def __init__(self) -> None:
        self.begun: list[int] = []
        self.started: list[StartedReplica] = []
        self.stopped = False

    def begin(self, index: int, metrics: EngineMetrics) -> None:
        self.begun.append(index)

    def ready(self) -> list[StartedReplica]:
        out, self.started = self.started, []
        return out

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _set(ctx: zmq.Context, num: int = 2) -> tuple[ReplicaSet, list[Core], Restarts]:
    cores = [Core(ctx) for _ in range(num)]
    restarts = Restarts()
    replica_set = ReplicaSet(
        [Replica(i, "cpu", core) for i, core in enumerate(cores)],  # type: ignore[arg-type]
        [EngineMetrics() for _ in cores],
        front_metrics=EngineMetrics(),
        restarts=restarts,  # type: ignore[arg-type]
        scheduler_config=cores[0].scheduler_config,
        cache_config=cores[0].cache_config,
        load_slack=0.5,
    )
    return replica_set, cores, restarts


def _prompt(n: int) -> ProcessedPrompt:
    return ProcessedPrompt([n, n + 1, n + 2])


def _routes(replica_set: ReplicaSet) -> dict[str, float]:
    return replica_set.front_metrics.snapshot().labelled_counters["dp_routed_requests"]


def test_a_repeated_prompt_goes_back_to_its_replica_and_each_choice_is_counted(ctx) -> None:
    replica_set, cores, _ = _set(ctx)
    replica_set.add_request("a", _prompt(1), PARAMS)
    first = replica_set.owner("a")
    assert first is not None
    cores[first].answer("a", finished=True)
    assert [u.request_id for u in replica_set.step()] == ["a"]
    assert not replica_set.has_unfinished_requests()
    replica_set.add_request("b", _prompt(1), PARAMS)
    assert replica_set.owner("b") == first
    assert _routes(replica_set) == {"affinity": 2}
    replica_set.shutdown()


def test_a_lost_replica_sends_unanswered_requests_elsewhere_and_fails_the_rest(ctx) -> None:
    replica_set, cores, restarts = _set(ctx)
    for n in range(6):  # the bound keeps the two replicas within 1.5x of the mean
        replica_set.add_request(f"r{n}", _prompt(10 * n), PARAMS)
    lost = max((0, 1), key=lambda i: len(cores[i].added))  # 3 or more of the 6
    other = 1 - lost
    on_lost = list(cores[lost].added)
    assert len(on_lost) >= 2, on_lost  # one to fail, at least one to send again
    cores[lost].answer(on_lost[0])  # one token streamed: it cannot be sent again
    assert len(replica_set.step()) == 1
    cores[lost].dead_reason = "the engine process exited (killed by signal 9)"
    updates = replica_set.step()
    assert [(u.request_id, u.finish_status) for u in updates] == [
        (on_lost[0], RequestStatus.FINISHED_ERROR)
    ]
    assert updates[0].error is not None and updates[0].error.kind is FailureKind.UNAVAILABLE
    assert set(on_lost[1:]) <= set(cores[other].added)  # sent again, to the live one
    assert all(replica_set.owner(r) == other for r in on_lost[1:])
    assert cores[lost].is_shut_down and restarts.begun == [lost]
    state = replica_set.states()[lost]
    assert not state.is_live and "signal 9" in (state.dead_reason or "")
    replica_set.add_request("new", _prompt(99), PARAMS)  # passed over at once
    assert replica_set.owner("new") == other
    replica_set.shutdown()
    assert restarts.stopped


def test_with_no_replica_live_requests_get_503_and_a_restarted_one_rejoins(ctx) -> None:
    replica_set, cores, restarts = _set(ctx)
    metrics = replica_set.replica_metrics[1]
    metrics.set_counter("encoder_items_encoded", 5)
    metrics.set_gauge("num_requests_running", 2)
    for core in cores:
        core.dead_reason = "gone"
    replica_set.check_alive()  # never raises: the set lives while replicas can come back
    assert sorted(restarts.begun) == [0, 1]
    with pytest.raises(NoReplicaAvailableError) as refused:
        replica_set.add_request("x", _prompt(1), PARAMS)
    assert refused.value.status_code == 503
    # the lost replica's gauges read 0; its process's counts go on from where they were
    assert metrics.snapshot().gauges["num_requests_running"] == 0
    fresh = Core(ctx)
    restarts.started.append(StartedReplica(1, "cpu", fresh, metrics, None))  # type: ignore[arg-type]
    assert replica_set.step() == []
    metrics.set_counter("encoder_items_encoded", 1)  # the new process's first encode
    assert metrics.snapshot().counters["encoder_items_encoded"] == 6
    assert [s.is_live for s in replica_set.states()] == [False, True]
    replica_set.add_request("x", _prompt(1), PARAMS)
    assert fresh.added == ["x"] and replica_set.owner("x") == 1
    replica_set.shutdown()
