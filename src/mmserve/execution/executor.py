"""The seam between the engine loop and whatever computes a step: the Executor protocol."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from mmserve.execution.model_runner import ModelRunner
from mmserve.multimodal import ItemData
from mmserve.scheduling.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    """Runs scheduled steps on one or more devices; `LLMEngine` knows nothing else of them.

    An executor may run its model in this process, in worker processes (one per tensor-parallel
    rank) or behind a remote encoder: the scheduler and the engine loop are the same for all.
    Steps arrive in order, one at a time, from one thread.
    """

    def add_mm_data(self, request_id: str, data: Mapping[str, ItemData]) -> None:
        """A new request's item data by identifier (pixels, or remote items for the encoder
        pool), handed over when the engine adds the request: the executor side owns it from
        here (the scheduler's request holds only specs), keeps it until the request's prefill
        has passed each item, then bounded for a re-encode after a preemption."""
        ...

    def free_mm_data(self, request_ids: Iterable[str]) -> None:
        """These requests are finished: drop the item data only they held."""
        ...

    def execute(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        """Run one step: encode the scheduled items, forward the scheduled tokens, sample.
        `grammar_output` masks the tokens the structured requests may sample.

        The answer accounts for every request in `scheduler_output.num_scheduled_tokens`:
        sampled token ids for each whose step reaches the end of its tokens, or an entry in
        `errors` for each that failed alone (a bad item, a count mismatch, a sampling error);
        requests still in a partial prefill may be absent. An executor never drops a request
        silently.

        Raising means the whole step failed and its outcome is unknown (a device fault, a dead
        worker): the engine fails every request of the step, then calls `check_health` to learn
        whether the executor can go on. After a raise the executor must still accept the
        `finished_req_ids` of later steps, so the state of the failed requests is freed.
        """
        ...

    def wait_for_encoder(self, timeout_s: float) -> None:
        """Block until the encoder source has something for a remote item in flight (so the
        next step has an arrival or a failure to report), or `timeout_s` has passed. Returns
        at once when nothing is in flight. The engine calls it after a step that scheduled
        nothing while items are in flight, so its loop neither spins nor sleeps past work."""
        ...

    def check_health(self) -> None:
        """Return if the executor can still compute; raise (any exception, with a message that
        says what is gone) if it cannot, e.g. a CUDA error or a worker that died. Cheap:
        called after every failed step."""
        ...

    def shutdown(self) -> None:
        """Release devices, workers, the encoder source and their memory. Idempotent; no call
        follows but another `shutdown`."""
        ...


class InProcessExecutor:
    """One ModelRunner in this process: the executor of a single-device engine."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.is_shut_down = False

    def add_mm_data(self, request_id: str, data: Mapping[str, ItemData]) -> None:
        self.runner.add_mm_data(request_id, data)

    def free_mm_data(self, request_ids: Iterable[str]) -> None:
        self.runner.free_mm_data(request_ids)

    def execute(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        if self.is_shut_down:
            raise RuntimeError("execute after shutdown: the executor's runner is released")
        return self.runner.execute(scheduler_output, grammar_output)

    def wait_for_encoder(self, timeout_s: float) -> None:
        if not self.is_shut_down:
            self.runner.wait_for_encoder(timeout_s)

    def check_health(self) -> None:
        if self.is_shut_down:
            raise RuntimeError("the executor was shut down")
        self.runner.check_device()

    def shutdown(self) -> None:
        # The runner holds the KV caches and the encoder cache: dropping its states is what
        # frees a request's memory; the tensors go with the runner when the engine goes.
        if self.is_shut_down:
            return
        self.is_shut_down = True
        self.runner.states.clear()
        self.runner.remote.shutdown()
