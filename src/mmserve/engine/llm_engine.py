"""LLMEngine: the synchronous engine loop — schedule, execute, update, emit outputs."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from mmserve.engine.output_processor import OutputProcessor
from mmserve.engine.outputs import RequestOutput
from mmserve.execution.model_runner import ModelRunner
from mmserve.execution.request_state import RunnerPayload
from mmserve.execution.sampler import make_generator
from mmserve.metrics import EngineMetrics
from mmserve.multimodal import ProcessedPrompt
from mmserve.processing.input_processor import InputProcessor
from mmserve.processing.mrope import decode_positions
from mmserve.sampling_params import SamplingParams
from mmserve.scheduling.outputs import ModelRunnerOutput
from mmserve.scheduling.request import Request, RequestStatus
from mmserve.scheduling.scheduler import Scheduler

logger = logging.getLogger(__name__)


class LLMEngine:
    """One model, one scheduler, one runner. Not thread-safe: one thread drives `step`."""

    def __init__(
        self,
        *,
        input_processor: InputProcessor,
        scheduler: Scheduler,
        runner: ModelRunner,
        output_processor: OutputProcessor,
        metrics: EngineMetrics,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.input_processor = input_processor
        self.scheduler = scheduler
        self.runner = runner
        self.output_processor = output_processor
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a processed prompt. Raises a typed 4xx error if it can never run."""
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
        request = Request(
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
        self.scheduler.add_request(request)
        self.output_processor.add_request(
            request_id, prompt.prompt, request.prompt_token_ids, params
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
        scheduler_output = self.scheduler.schedule()
        runner_output = self._execute(scheduler_output)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, stopped = self.output_processor.process(updates)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self._record_stats()
        return outputs

    def _execute(self, scheduler_output) -> ModelRunnerOutput:
        """Run the step; a crash of the forward pass fails the requests in it, not the engine."""
        try:
            return self.runner.execute(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - contained to the requests of this step
            logger.exception(
                "model step failed; failing the %d requests in it",
                len(scheduler_output.num_scheduled_tokens),
            )
            message = f"internal error while running the model: {type(exc).__name__}"
            return ModelRunnerOutput(
                {}, dict.fromkeys(scheduler_output.num_scheduled_tokens, message)
            )

    def _record_stats(self) -> None:
        s = self.scheduler.make_stats()
        m = self.metrics
        m.set_gauge("num_requests_running", s.num_running)
        m.set_gauge("num_requests_waiting", s.num_waiting)
        m.set_gauge("kv_blocks_free", s.num_free_kv_blocks)
        m.set_gauge("encoder_cache_used_slots", s.encoder_cache_used_slots)
        m.set_gauge("encoder_cache_resident_slots", s.encoder_cache_resident_slots)
        m.set_counter("prefix_cache_queries", s.prefix_cache_queries)
        m.set_counter("prefix_cache_hits", s.prefix_cache_hits)
        m.set_counter("encoder_cache_queries", s.encoder_cache_queries)
        m.set_counter("encoder_cache_hits", s.encoder_cache_hits)
        cache_stats = self.input_processor.cache.stats
        m.set_counter("processor_cache_queries", cache_stats.queries)
        m.set_counter("processor_cache_hits", cache_stats.hits)
