"""Turns scheduler updates into RequestOutputs: detokenize, stop strings, latency metrics."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from mmserve.engine.detokenizer import DecodeFn, IncrementalDetokenizer
from mmserve.engine.outputs import CompletionOutput, OutputKind, RequestOutput
from mmserve.engine.request_timing import RequestTimes
from mmserve.errors import FailureKind, RequestFailure
from mmserve.metrics import EngineMetrics
from mmserve.sampling_params import SamplingParams
from mmserve.scheduling.outputs import RequestUpdate
from mmserve.scheduling.request import FINISH_REASONS

logger = logging.getLogger(__name__)


class ProcessedStep(NamedTuple):
    """The outputs of one step, and the requests the scheduler must now finish."""

    outputs: list[RequestOutput]
    stopped_ids: list[str]  # a stop string appeared in the text
    failed_ids: list[str]  # detokenizing or stop-string matching raised


@dataclass
class _Tracked:
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    times: RequestTimes
    kind: OutputKind
    token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0


class OutputProcessor:
    """Per-request detokenization state; the engine feeds it every step's updates."""

    def __init__(self, decode: DecodeFn, metrics: EngineMetrics) -> None:
        self._decode = decode
        self._metrics = metrics
        self._requests: dict[str, _Tracked] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        *,
        arrival_s: float | None = None,
    ) -> None:
        """`arrival_s` (`time.monotonic()`, default now) is when the engine took the request:
        taken before the core could schedule it, so no queue time comes out negative."""
        detok = IncrementalDetokenizer(
            self._decode,
            params.stop,
            skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        times = RequestTimes(time.monotonic() if arrival_s is None else arrival_s)
        self._requests[request_id] = _Tracked(prompt, prompt_token_ids, detok, times, output_kind)
        self._metrics.inc("prompt_tokens", len(prompt_token_ids))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def request_ids(self) -> set[str]:
        return set(self._requests)

    def process(self, updates: list[RequestUpdate]) -> ProcessedStep:
        """The outputs of this step; a request whose text cannot be made fails alone."""
        step = ProcessedStep([], [], [])
        now = time.monotonic()
        for update in updates:
            tracked = self._requests.get(update.request_id)
            if tracked is None:
                continue
            if update.first_scheduled_time_s is not None:
                tracked.times.on_scheduled(update.first_scheduled_time_s)
            if update.new_token_ids:
                self._observe_latency(tracked, now, len(update.new_token_ids))
            tracked.token_ids.extend(update.new_token_ids)
            tracked.num_cached_tokens = update.num_cached_tokens
            finish_reason = FINISH_REASONS.get(update.finish_status) if update.finished else None
            stop_reason: str | int | None = update.stop_reason
            failure = update.error
            try:
                delta = tracked.detokenizer.add_tokens(update.new_token_ids)
            except Exception as exc:  # noqa: BLE001 - fails this request only; logged once
                logger.exception("request %s: detokenizing failed", update.request_id)
                delta, finish_reason, stop_reason = "", "error", None
                failure = RequestFailure(
                    f"detokenizing the output failed: {type(exc).__name__}", FailureKind.INTERNAL
                )
                step.failed_ids.append(update.request_id)
            if finish_reason is None and tracked.detokenizer.stop_reason is not None:
                finish_reason, stop_reason = "stop", tracked.detokenizer.stop_reason
                step.stopped_ids.append(update.request_id)
            if finish_reason is None and tracked.kind is OutputKind.FINAL_ONLY:
                continue
            step.outputs.append(
                self._output(
                    update.request_id,
                    tracked,
                    delta,
                    update.new_token_ids,
                    finish_reason,
                    stop_reason,
                    failure,
                )
            )
            if finish_reason is not None:
                self._finish(update.request_id, finish_reason, now)
        return step

    def abort(self, request_id: str) -> RequestOutput | None:
        """Final output of a request aborted from outside the step (client gone, shutdown)."""
        return self._end(request_id, "abort", None)

    def fail(self, request_id: str, failure: RequestFailure) -> RequestOutput | None:
        """Final output of a request failed from outside the step (a failed engine step)."""
        return self._end(request_id, "error", failure)

    def _end(
        self, request_id: str, reason: str, failure: RequestFailure | None
    ) -> RequestOutput | None:
        tracked = self._requests.get(request_id)
        if tracked is None:
            return None
        self._finish(request_id, reason, time.monotonic())
        return self._output(request_id, tracked, "", [], reason, None, failure)

    def _output(
        self,
        request_id: str,
        tracked: _Tracked,
        delta_text: str,
        delta_ids: list[int],
        finish_reason: str | None,
        stop_reason: str | int | None,
        failure: RequestFailure | None,
    ) -> RequestOutput:
        if tracked.kind is OutputKind.DELTA:
            text, token_ids = delta_text, list(delta_ids)
        else:
            text, token_ids = tracked.detokenizer.text, list(tracked.token_ids)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            delta_text=delta_text,
            delta_token_ids=list(delta_ids),
            num_tokens=len(tracked.token_ids),
        )
        return RequestOutput(
            request_id=request_id,
            prompt=tracked.prompt,
            prompt_token_ids=tracked.prompt_token_ids,
            outputs=[completion],
            finished=finish_reason is not None,
            num_cached_tokens=tracked.num_cached_tokens,
            error=None if failure is None else failure.message,
            error_kind=None if failure is None else failure.kind,
            error_param=None if failure is None else failure.param,
        )

    def _observe_latency(self, tracked: _Tracked, now: float, num_new: int) -> None:
        times = tracked.times
        if times.last_token_s is None:
            self._metrics.observe_ttft(now - times.arrival_s)
        else:
            self._metrics.observe_itl((now - times.last_token_s) / num_new)
        times.on_tokens(now)
        self._metrics.inc("generation_tokens", num_new)

    def _finish(self, request_id: str, reason: str, now: float) -> None:
        tracked = self._requests.pop(request_id)
        self._metrics.inc("requests_failed" if reason == "error" else "requests_finished")
        num_prompt, num_generated = len(tracked.prompt_token_ids), len(tracked.token_ids)
        self._metrics.record_finished(
            tracked.times.finished(now, reason, num_prompt, num_generated)
        )
