"""Turns scheduler updates into RequestOutputs: detokenize, stop strings, latency metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mmserve.engine.detokenizer import DecodeFn, IncrementalDetokenizer
from mmserve.engine.outputs import CompletionOutput, RequestOutput
from mmserve.metrics import EngineMetrics
from mmserve.sampling_params import SamplingParams
from mmserve.scheduling.outputs import RequestUpdate
from mmserve.scheduling.request import RequestStatus

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class _Tracked:
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    arrival_s: float
    token_ids: list[int] = field(default_factory=list)
    last_token_s: float | None = None


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
    ) -> None:
        detok = IncrementalDetokenizer(
            self._decode,
            params.stop,
            skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        self._requests[request_id] = _Tracked(prompt, prompt_token_ids, detok, time.monotonic())
        self._metrics.inc("prompt_tokens", len(prompt_token_ids))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs of this step and the ids a stop string has just finished."""
        outputs: list[RequestOutput] = []
        stopped_by_string: list[str] = []
        now = time.monotonic()
        for update in updates:
            tracked = self._requests.get(update.request_id)
            if tracked is None:
                continue
            if update.new_token_ids:
                self._observe_latency(tracked, now, len(update.new_token_ids))
            tracked.token_ids.extend(update.new_token_ids)
            delta = tracked.detokenizer.add_tokens(update.new_token_ids)
            finish_reason = FINISH_REASONS.get(update.finish_status) if update.finished else None
            stop_reason: str | int | None = update.stop_reason
            if finish_reason is None and tracked.detokenizer.stop_reason is not None:
                finish_reason, stop_reason = "stop", tracked.detokenizer.stop_reason
                stopped_by_string.append(update.request_id)
            outputs.append(
                self._output(
                    update.request_id,
                    tracked,
                    delta,
                    update.new_token_ids,
                    finish_reason,
                    stop_reason,
                    update.error,
                )
            )
            if finish_reason is not None:
                self._finish(update.request_id, finish_reason)
        return outputs, stopped_by_string

    def abort(
        self, request_id: str, reason: str = "abort", error: str | None = None
    ) -> RequestOutput | None:
        """Final output of a request finished from outside the step (abort, engine error)."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            return None
        self._finish(request_id, reason)
        return self._output(request_id, tracked, "", [], reason, None, error)

    def _output(
        self,
        request_id: str,
        tracked: _Tracked,
        delta_text: str,
        delta_ids: list[int],
        finish_reason: str | None,
        stop_reason: str | int | None,
        error: str | None,
    ) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=tracked.detokenizer.text,
            token_ids=list(tracked.token_ids),
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            delta_text=delta_text,
            delta_token_ids=list(delta_ids),
        )
        return RequestOutput(
            request_id=request_id,
            prompt=tracked.prompt,
            prompt_token_ids=tracked.prompt_token_ids,
            outputs=[completion],
            finished=finish_reason is not None,
            error=error,
        )

    def _observe_latency(self, tracked: _Tracked, now: float, num_new: int) -> None:
        if tracked.last_token_s is None:
            self._metrics.observe_ttft(now - tracked.arrival_s)
        else:
            self._metrics.observe_itl((now - tracked.last_token_s) / num_new)
        tracked.last_token_s = now
        self._metrics.inc("generation_tokens", num_new)

    def _finish(self, request_id: str, reason: str) -> None:
        del self._requests[request_id]
        self._metrics.inc("requests_failed" if reason == "error" else "requests_finished")
