"""EngineCore: the scheduler and the executor, stepped together; what the engine process runs.

It speaks in token ids (`RequestUpdate`s): text, stop strings and latency metrics belong to the
front end (`LLMEngine` over an `OutputProcessor`), which may live in another process.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import NoReturn

import msgspec

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.errors import EngineDeadError, FailureKind, InvalidRequestError, RequestFailure
from mmserve.execution.executor import Executor
from mmserve.execution.request_state import RunnerPayload
from mmserve.metrics import EngineMetrics, record_scheduler_stats
from mmserve.multimodal import ProcessedPrompt
from mmserve.processing.mrope import decode_positions
from mmserve.sampling_params import SamplingParams
from mmserve.scheduling.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from mmserve.scheduling.request import Request
from mmserve.scheduling.scheduler import Scheduler
from mmserve.structured_output.manager import StructuredOutputManager
from mmserve.updates import RequestStatus, RequestUpdate

logger = logging.getLogger(__name__)

# The longest a step that scheduled nothing waits for a remote item: short, because the loop
# around the core reads new requests and aborts only between steps.
ENCODER_WAIT_S = 0.02


def make_request(
    request_id: str,
    prompt: ProcessedPrompt,
    params: SamplingParams,
    *,
    eos_token_ids: tuple[int, ...],
    cache_salt: str | None = None,
) -> Request:
    """The one scheduler request of an admitted prompt (`scheduling.admission`), with what the
    runner needs as its payload."""
    num_prompt = len(prompt.prompt_token_ids)
    if params.max_tokens is None:
        raise ValueError(
            f"request {request_id}: max_tokens is None; admission (LLMEngine.add_request) "
            "resolves it before a core sees the request"
        )
    positions, delta = prompt.mrope_positions, prompt.mrope_position_delta
    if positions is None:  # a text-only prompt built without the processor
        positions, delta = decode_positions(0, num_prompt, 0), 0
    payload = RunnerPayload(
        sampling_params=params,
        mrope_positions=positions,
        mrope_position_delta=delta,
        eos_token_ids=eos_token_ids,
    )
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt.prompt_token_ids),
        mm_features=list(prompt.mm_features),
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos,
        stop_token_ids=params.stop_token_ids,
        cache_salt=cache_salt,
        skip_reading_prefix_cache=params.prompt_logprobs is not None,
        payload=payload,
    )


class EngineCore:
    """One scheduler, one executor. Not thread-safe: one thread drives `step`.

    No request's content can stop it: a request that breaks fails alone, and a step that
    raises fails the requests in it. The core declares itself dead (every later `step` raises
    EngineDeadError) only when, after a failed step, the device or the scheduler's bookkeeping
    no longer checks out: counting failures instead would let a few hostile requests in a row
    kill the server.
    """

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        executor: Executor,
        metrics: EngineMetrics,
        eos_token_ids: tuple[int, ...],
        structured_output: StructuredOutputManager | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.metrics = metrics
        self.eos_token_ids = eos_token_ids
        self.structured_output = structured_output  # grammar matchers; None: refused
        self.dead_reason: str | None = None  # set once, when the core can no longer run

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a prompt the front end admitted (`LLMEngine.add_request`); raises a typed 4xx
        error only for a grammar this engine cannot take."""
        self._raise_if_dead()
        matcher = None
        if params.structured_outputs is not None:
            if self.structured_output is None:
                raise InvalidRequestError(
                    "structured output is not available in this engine", param="structured_outputs"
                )
            matcher = self.structured_output.make_matcher(params.structured_outputs)
        request = make_request(
            request_id,
            prompt,
            params,
            eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt,
        )
        self.scheduler.add_request(request)
        if prompt.mm_data:
            self.executor.add_mm_data(request_id, prompt.mm_data)
        if matcher is not None:
            assert self.structured_output is not None
            self.structured_output.register(request_id, matcher)

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.scheduler.scheduler_config

    @property
    def cache_config(self) -> CacheConfig:
        return self.scheduler.cache_config

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish from outside a step (abort, stop string); unknown ids are ignored."""
        ids = list(request_ids)
        self.scheduler.finish_requests(ids, status)
        self.executor.free_mm_data(ids)
        if self.structured_output is not None:
            self.structured_output.free(ids)
        self._record_stats()  # the core may go idle now: gauges must not stay stale

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def check_alive(self) -> None:
        self._raise_if_dead()

    def wake(self) -> None:
        """Nothing to do: `step` never waits for anything a new request should interrupt."""

    def step(self) -> list[RequestUpdate]:
        """schedule -> execute -> update. Raises only EngineDeadError."""
        self._raise_if_dead()
        try:
            scheduler_output = self.scheduler.schedule()
            grammar = self.structured_output
            if grammar is None:
                runner_output = self._execute(scheduler_output)
                updates = self.scheduler.update_from_output(scheduler_output, runner_output)
            else:
                mask = grammar.grammar_output(scheduler_output, self.scheduler.requests)
                runner_output = self._execute(scheduler_output, mask.grammar_output)
                runner_output, completed = grammar.accept_step(runner_output, mask.failures)
                updates = self.scheduler.update_from_output(scheduler_output, runner_output)
                updates = self._stop_completed(updates, completed)
                grammar.retain(self.scheduler.requests)
            self._record_stats()
            finished = [u.request_id for u in updates if u.finish_status is not None]
            if finished:
                self.executor.free_mm_data(finished)
            self._wait_if_only_in_flight(scheduler_output, runner_output)
        except EngineDeadError:
            raise
        except Exception:  # noqa: BLE001 - a bug outside the model: contained below
            return self._fail_unfinished()
        return updates

    def _wait_if_only_in_flight(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> None:
        """A step that scheduled nothing and heard nothing from the encoder source while items
        are in flight would repeat itself at once: wait for the source instead of spinning."""
        if (
            scheduler_output.total_num_scheduled_tokens == 0
            and not runner_output.encoder_arrived
            and not runner_output.encoder_failed
            and self.scheduler.encoder_cache_manager.inflight
        ):
            self.executor.wait_for_encoder(ENCODER_WAIT_S)

    def _stop_completed(
        self, updates: list[RequestUpdate], completed: set[str]
    ) -> list[RequestUpdate]:
        """A request whose grammar is complete (nothing more may follow) finishes "stop" now,
        without waiting for the model to choose EOS."""
        stop = {r for r in completed if r in self.scheduler.requests}
        if not stop:
            return updates
        status = RequestStatus.FINISHED_STOPPED
        self.scheduler.finish_requests(stop, status)
        return [
            msgspec.structs.replace(u, finish_status=status) if u.request_id in stop else u
            for u in updates
        ]

    def _fail_unfinished(self) -> list[RequestUpdate]:
        """Fail every unfinished request (which ones a failed step touched is unknown); the
        core goes on if it is still sound."""
        request_ids = sorted(self.scheduler.requests)
        logger.exception("engine step failed; failing every unfinished request: %s", request_ids)
        failure = RequestFailure("internal error in the engine step", FailureKind.INTERNAL)
        try:
            self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
            self.executor.free_mm_data(request_ids)
            if self.structured_output is not None:
                self.structured_output.free(request_ids)
            self._record_stats()
        except Exception as exc:  # noqa: BLE001 - the books cannot even be closed
            self._declare_dead(exc)
        self._check_sound()
        status = RequestStatus.FINISHED_ERROR
        return [RequestUpdate(i, [], status, error=failure) for i in request_ids]

    def check_health(self) -> None:
        """While idle: EngineDeadError when the executor can no longer compute (a worker
        process that died between steps), so the server learns of it before the next request."""
        self._raise_if_dead()
        try:
            self.executor.check_health()
        except Exception as exc:  # noqa: BLE001 - whatever it is, the core cannot go on
            self._declare_dead(exc)

    def shutdown(self) -> None:
        self.executor.shutdown()

    def _execute(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        """Run the step; a crash of the forward pass fails the requests in it, not the core."""
        try:
            return self.executor.execute(scheduler_output, grammar_output)
        except Exception:  # noqa: BLE001 - contained to the requests of this step
            request_ids = sorted(scheduler_output.num_scheduled_tokens)
            logger.exception("model step failed; failing the requests in it: %s", request_ids)
            self._check_sound()
            failure = RequestFailure("internal error while running the model", FailureKind.INTERNAL)
            # NOTE: what arrived from the encoder source in the failed step is lost: the
            # requests waiting for items in flight fail too, or they would wait forever.
            inflight = self.scheduler.encoder_cache_manager.inflight
            return ModelRunnerOutput(
                {},
                dict.fromkeys(request_ids, failure),
                encoder_failed=dict.fromkeys(inflight, failure),
            )

    def _check_sound(self) -> None:
        """After a failed step: declare the core dead unless the device still computes and the
        scheduler's books still balance."""
        try:
            self.executor.check_health()
            self.scheduler.check_integrity()
        except Exception as exc:  # noqa: BLE001 - whatever it is, the core cannot go on
            self._declare_dead(exc)

    def _declare_dead(self, exc: Exception) -> NoReturn:
        logger.exception("the engine cannot go on after a failed step")
        self.dead_reason = f"{type(exc).__name__} after a failed step"
        raise EngineDeadError(self.dead_reason) from exc

    def _raise_if_dead(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def _record_stats(self) -> None:
        record_scheduler_stats(self.metrics, self.scheduler.make_stats())
        self.metrics.set_counter("num_preemptions", self.scheduler.num_preemptions)
