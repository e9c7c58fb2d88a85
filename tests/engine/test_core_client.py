"""The API process's client of an engine-core process, driven directly: requests and aborts
cross, outputs come back as the in-process core's, a duplicate id is refused before sending,
and a dead engine is reported rather than waited for."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from mmserve.config.engine import EngineConfig
from mmserve.config.model import bundled_toy_model_dir
from mmserve.engine.core.build import build_core
from mmserve.engine.frontend import core_client as core_client_module
from mmserve.engine.frontend.core_client import CoreClient
from mmserve.engine.shape import resolve_shape
from mmserve.errors import EngineDeadError
from mmserve.metrics import EngineMetrics
from mmserve.multimodal import ProcessedPrompt
from mmserve.sampling_params import SamplingParams
from mmserve.updates import RequestStatus, RequestUpdate

MAX_MODEL_LEN = 256
ARGS = EngineConfig.from_kwargs(
    model=bundled_toy_model_dir(), max_model_len=MAX_MODEL_LEN, max_num_seqs=8
)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = {
    "short": ProcessedPrompt([11, 12, 13, 14]),
    "longer": ProcessedPrompt([(7 * i) % 400 + 20 for i in range(40)]),
}


def _start() -> tuple[CoreClient, EngineMetrics]:
    metrics = EngineMetrics()
    client, _ = CoreClient.start(ARGS, metrics)
    return client, metrics


@pytest.fixture(scope="module")
def client() -> Iterator[CoreClient]:
    client, _ = _start()
    yield client
    client.shutdown()


def _run(core, timeout_s: float = 60.0) -> dict[str, list[RequestUpdate]]:
    """Step until nothing is unfinished; every update, by request."""
    updates: dict[str, list[RequestUpdate]] = {}
    deadline = time.monotonic() + timeout_s
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine stopped answering"
        for update in core.step():
            updates.setdefault(update.request_id, []).append(update)
    return updates


def _idle(metrics: EngineMetrics) -> bool:
    gauges = metrics.snapshot().gauges
    running = gauges.get("num_requests_running", 0) + gauges.get("num_requests_waiting", 0)
    return running == 0 and gauges.get("kv_blocks_free") == gauges.get("kv_blocks_total")


def _tokens(updates: list[RequestUpdate]) -> list[int]:
    return [t for u in updates for t in u.new_token_ids]


def test_outputs_come_back_as_the_in_process_core_gives_them(client: CoreClient) -> None:
    core, _ = build_core(ARGS, resolve_shape(ARGS), EngineMetrics())
    try:
        for name, prompt in PROMPTS.items():
            core.add_request(name, prompt, GREEDY)
        expected = _run(core)
    finally:
        core.shutdown()
    for name, prompt in PROMPTS.items():
        client.add_request(name, prompt, GREEDY)
    assert client.has_unfinished_requests()
    got = _run(client)
    assert set(got) == set(PROMPTS)
    for name in PROMPTS:
        assert _tokens(got[name]) == _tokens(expected[name])
        assert len(_tokens(got[name])) == GREEDY.max_tokens
        assert [u.finished for u in got[name]][-1] and not any(u.finished for u in got[name][:-1])
        assert got[name][-1].finish_status == RequestStatus.FINISHED_LENGTH


def test_an_abort_crosses_and_the_engine_goes_on(client: CoreClient) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    client.add_request("long", PROMPTS["short"], long)
    deadline = time.monotonic() + 60
    while not client.step():  # the engine process runs it
        assert time.monotonic() < deadline
    client.finish_requests(["long"], RequestStatus.FINISHED_ABORTED)
    assert not client.has_unfinished_requests()
    # The engine process stops it: its stats come back with nothing running, every block free.
    deadline = time.monotonic() + 30
    while not _idle(client.metrics):
        assert time.monotonic() < deadline, "the aborted request kept running"
        client.check_alive()
        time.sleep(0.01)
    client.finish_requests(["long"], RequestStatus.FINISHED_ABORTED)  # twice: nothing sent
    client.add_request("after", PROMPTS["short"], GREEDY)
    assert len(_tokens(_run(client)["after"])) == GREEDY.max_tokens


def test_a_duplicate_request_id_is_refused_before_it_is_sent(client: CoreClient) -> None:
    # Admission (prompt length, budgets) is the front end's, once, before the client is called:
    # tests/engine/test_multiprocess.py checks that a request that can never run is refused.
    client.add_request("dup", PROMPTS["short"], GREEDY)
    with pytest.raises(ValueError, match="already in the engine"):
        client.add_request("dup", PROMPTS["short"], GREEDY)
    assert len(_tokens(_run(client)["dup"])) == GREEDY.max_tokens


def test_a_dead_engine_process_is_reported_not_waited_for() -> None:
    client, _ = _start()
    try:
        client.add_request("orphan", PROMPTS["short"], SamplingParams(max_tokens=200))
        client.proc.kill()
        client.proc.wait(10)
        started = time.monotonic()
        with pytest.raises(EngineDeadError) as dead:
            while True:
                client.step()
        assert time.monotonic() - started < 5.0
        assert "killed by signal 9" in dead.value.reason  # what the server log says
        assert not client.has_unfinished_requests()  # nothing left to wait for
        with pytest.raises(EngineDeadError):
            client.add_request("late", PROMPTS["short"], GREEDY)
    finally:
        client.shutdown()
        client.shutdown()  # idempotent


def test_a_wake_ends_a_step_that_waits_for_outputs(
    client: CoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request handed to the engine thread while it waits for a step's outputs is sent at
    once: the wait ends on `wake`, not when the outputs come (here none ever will)."""
    monkeypatch.setattr(core_client_module, "STEP_POLL_MS", 600_000)
    assert not client.has_unfinished_requests()
    results: list[list[RequestUpdate]] = []
    stepper = threading.Thread(target=lambda: results.append(client.step()))
    stepper.start()
    client.wake()
    stepper.join(60.0)
    assert not stepper.is_alive() and results == [[]]
