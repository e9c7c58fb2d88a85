"""LLMEngine: the synchronous engine loop — schedule, execute, update, emit outputs."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import NoReturn

from mmserve.engine.output_processor import OutputProcessor
from mmserve.engine.outputs import RequestOutput
from mmserve.errors import EngineDeadError, FailureKind, RequestFailure
from mmserve.execution.executor import Executor
from mmserve.execution.request_state import RunnerPayload
from mmserve.execution.sampler import make_generator
from mmserve.metrics import EngineMetrics, record_scheduler_stats
from mmserve.multimodal import ProcessedPrompt
from mmserve.processing.input_processor import InputProcessor
from mmserve.processing.mrope import decode_positions
from mmserve.sampling_params import SamplingParams
from mmserve.scheduling.outputs import ModelRunnerOutput, SchedulerOutput
from mmserve.scheduling.request import Request, RequestStatus
from mmserve.scheduling.scheduler import Scheduler

logger = logging.getLogger(__name__)


class LLMEngine:
    """One model, one scheduler, one executor. Not thread-safe: one thread drives `step`.

    No request's content can stop it: a request that breaks fails alone, and a step that
    raises fails the requests in it. The engine declares itself dead (every later `step`
    raises EngineDeadError) only when, after a failed step, the device or the scheduler's
    bookkeeping no longer checks out: counting failures instead would let a few hostile
    requests in a row kill the server.
    """

    def __init__(
        self,
        *,
        input_processor: InputProcessor,
        scheduler: Scheduler,
        executor: Executor,
        output_processor: OutputProcessor,
        metrics: EngineMetrics,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.input_processor = input_processor
        self.scheduler = scheduler
        self.executor = executor
        self.output_processor = output_processor
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.dead_reason: str | None = None  # set once, when the engine can no longer run

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a processed prompt. Raises a typed 4xx error if it can never run; whatever it
        raises, nothing of the request is left behind."""
        self._raise_if_dead()
        request = self._make_request(request_id, prompt, params, cache_salt)
        self.scheduler.add_request(request)
        try:
            self.output_processor.add_request(
                request_id, prompt.prompt, request.prompt_token_ids, params
            )
        except BaseException:
            self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
            raise

    def _make_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        cache_salt: str | None,
    ) -> Request:
        num_prompt = len(prompt.prompt_token_ids)
        max_tokens = self.max_model_len - num_prompt
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        positions, delta = prompt.mrope_positions, prompt.mrope_position_delta
        if positions is None:  # a text-only prompt built without the processor
            positions, delta = decode_positions(0, num_prompt, 0), 0
        payload = RunnerPayload(
            sampling_params=params,
            mrope_positions=positions,
            mrope_position_delta=delta,
            eos_token_ids=self.eos_token_ids,
            generator=make_generator(params.seed) if params.seed is not None else None,
        )
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt.prompt_token_ids),
            mm_features=list(prompt.mm_features),
            max_tokens=max(max_tokens, 1),
            min_tokens=params.min_tokens,
            ignore_eos=params.ignore_eos,
            stop_token_ids=params.stop_token_ids,
            cache_salt=cache_salt,
            payload=payload,
        )

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        ids = list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        outputs = [out for i in ids if (out := self.output_processor.abort(i)) is not None]
        self._record_stats()  # the engine may go idle now: gauges must not stay stale
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """schedule -> execute -> update -> outputs. Raises only EngineDeadError."""
        self._raise_if_dead()
        try:
            scheduler_output = self.scheduler.schedule()
            runner_output = self._execute(scheduler_output)
            updates = self.scheduler.update_from_output(scheduler_output, runner_output)
            step = self.output_processor.process(updates)
            self.scheduler.finish_requests(step.stopped_ids, RequestStatus.FINISHED_STOPPED)
            self.scheduler.finish_requests(step.failed_ids, RequestStatus.FINISHED_ERROR)
            self._record_stats()
        except EngineDeadError:
            raise
        except Exception:  # noqa: BLE001 - a bug outside the model: contained below
            return self._fail_unfinished()
        return step.outputs

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step; a crash of the forward pass fails the requests in it, not the engine."""
        try:
            return self.executor.execute(scheduler_output)
        except Exception:  # noqa: BLE001 - contained to the requests of this step
            request_ids = sorted(scheduler_output.num_scheduled_tokens)
            logger.exception("model step failed; failing the requests in it: %s", request_ids)
            self._check_sound()
            failure = RequestFailure("internal error while running the model", FailureKind.INTERNAL)
            return ModelRunnerOutput({}, dict.fromkeys(request_ids, failure))

    def _fail_unfinished(self) -> list[RequestOutput]:
        """A step raised outside the model (scheduler, outputs): which requests it touched is
        unknown, so every unfinished one fails; the engine goes on if it is still sound."""
        request_ids = sorted(set(self.scheduler.requests) | self.output_processor.request_ids)
        logger.exception("engine step failed; failing every unfinished request: %s", request_ids)
        failure = RequestFailure("internal error in the engine step", FailureKind.INTERNAL)
        try:
            self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
            outputs = [o for i in request_ids if (o := self.output_processor.fail(i, failure))]
            self._record_stats()
        except Exception as exc:  # noqa: BLE001 - the books cannot even be closed
            self._declare_dead(exc)
        self._check_sound()
        return outputs

    def _check_sound(self) -> None:
        """After a failed step: declare the engine dead unless the device still computes and
        the scheduler's books still balance."""
        try:
            self.executor.check_health()
            self.scheduler.check_integrity()
        except Exception as exc:  # noqa: BLE001 - whatever it is, the engine cannot go on
            self._declare_dead(exc)

    def _declare_dead(self, exc: Exception) -> NoReturn:
        logger.exception("the engine cannot go on after a failed step")
        self.dead_reason = f"{type(exc).__name__} after a failed step"
        raise EngineDeadError(self.dead_reason) from exc

    def _raise_if_dead(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def _record_stats(self) -> None:
        m = self.metrics
        record_scheduler_stats(m, self.scheduler.make_stats())
        cache_stats = self.input_processor.cache.stats
        m.set_counter("processor_cache_queries", cache_stats.queries)
        m.set_counter("processor_cache_hits", cache_stats.hits)
