"""LLMEngine: the synchronous engine loop — core step (schedule, execute, update), then outputs."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from mmserve.engine.core import CoreLike, EngineCore
from mmserve.engine.output_processor import OutputProcessor
from mmserve.engine.outputs import OutputKind, RequestOutput
from mmserve.errors import EngineDeadError, FailureKind, RequestFailure
from mmserve.metrics import EngineMetrics
from mmserve.multimodal import ProcessedPrompt
from mmserve.processing.input_processor import InputProcessor
from mmserve.sampling_params import SamplingParams
from mmserve.scheduling.request import RequestStatus

logger = logging.getLogger(__name__)


class LLMEngine:
    """The front end of one engine core: prompts in, `RequestOutput`s (text) out.

    The core (scheduler + executor) runs in this process (`EngineCore`) or in an engine
    process (`engine.core_client.CoreClient`); this loop is the same for both. Not
    thread-safe: one thread drives `step`. A request that breaks fails alone; `step` raises
    only EngineDeadError, when the core can no longer run.
    """

    def __init__(
        self,
        *,
        input_processor: InputProcessor,
        core: CoreLike,
        output_processor: OutputProcessor,
        metrics: EngineMetrics,
        max_model_len: int,
    ) -> None:
        self.input_processor = input_processor
        self.core = core
        self.output_processor = output_processor
        self.metrics = metrics
        self.max_model_len = max_model_len

    # In-process conveniences (tests, tools): the scheduler and executor of a local core.
    @property
    def scheduler(self):  # -> Scheduler
        return self._local_core().scheduler

    @property
    def executor(self):  # -> Executor
        return self._local_core().executor

    def _local_core(self) -> EngineCore:
        if not isinstance(self.core, EngineCore):
            raise AttributeError("the engine core runs in another process")
        return self.core

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> None:
        """Queue a processed prompt. Raises a typed 4xx error if it can never run; whatever it
        raises, nothing of the request is left behind."""
        # Before the core has it: an engine process may schedule it at once (queue time >= 0).
        arrival_s = time.monotonic()
        self.core.add_request(request_id, prompt, params, cache_salt=cache_salt)
        try:
            self.output_processor.add_request(
                request_id,
                prompt.prompt,
                prompt.prompt_token_ids,
                params,
                output_kind,
                arrival_s=arrival_s,
            )
        except BaseException:
            self.core.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
            raise

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        ids = list(request_ids)
        self.core.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        return [out for i in ids if (out := self.output_processor.abort(i)) is not None]

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    @property
    def dead_reason(self) -> str | None:
        """Why the core can no longer run, or None while it can."""
        return self.core.dead_reason

    def check_alive(self) -> None:
        """Raise EngineDeadError if the core has died (called while idle)."""
        self.core.check_alive()

    def step(self) -> list[RequestOutput]:
        """core step -> text and stop strings -> outputs. Raises only EngineDeadError."""
        updates = self.core.step()
        try:
            step = self.output_processor.process(updates)
            self.core.finish_requests(step.stopped_ids, RequestStatus.FINISHED_STOPPED)
            self.core.finish_requests(step.failed_ids, RequestStatus.FINISHED_ERROR)
            self._record_stats()
        except EngineDeadError:
            raise
        except Exception:  # noqa: BLE001 - a bug in the outputs: contained below
            return self._fail_unfinished()
        return step.outputs

    def shutdown(self) -> None:
        self.core.shutdown()

    def _fail_unfinished(self) -> list[RequestOutput]:
        """Making outputs raised: which requests it touched is unknown, so every unfinished
        one fails; the engine goes on."""
        request_ids = sorted(self.output_processor.request_ids)
        logger.exception("engine outputs failed; failing every unfinished request: %s", request_ids)
        failure = RequestFailure("internal error in the engine step", FailureKind.INTERNAL)
        try:
            self.core.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
            return [o for i in request_ids if (o := self.output_processor.fail(i, failure))]
        except EngineDeadError:
            raise
        except Exception as exc:  # noqa: BLE001 - the books cannot even be closed
            logger.exception("the engine cannot go on after a failed step")
            raise EngineDeadError(f"{type(exc).__name__} after a failed step") from exc

    def _record_stats(self) -> None:
        cache_stats = self.input_processor.cache.stats
        self.metrics.set_counter("processor_cache_queries", cache_stats.queries)
        self.metrics.set_counter("processor_cache_hits", cache_stats.hits)
