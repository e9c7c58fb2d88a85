"""Turns scheduler updates into RequestOutputs: detokenize, stop strings, logprobs, n samples.

A client request with n > 1 runs as n core requests (its children, `LLMEngine` names them);
this gathers their updates into one RequestOutput per step whose `outputs` holds the n
sequences. A child that fails fails the whole request, and its unfinished siblings are handed
back in `failed_ids` for the core to finish.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from mmserve.engine.frontend.detokenizer import DecodeFn, IncrementalDetokenizer
from mmserve.engine.frontend.logprobs import decode_logprobs
from mmserve.engine.frontend.outputs import (
    CompletionOutput,
    OutputKind,
    RequestOutput,
    TokenLogprobs,
    merge_completion,
)
from mmserve.engine.frontend.request_timing import RequestTimes
from mmserve.errors import FailureKind, RequestFailure
from mmserve.metrics import EngineMetrics
from mmserve.sampling_params import SamplingParams
from mmserve.updates import FINISH_REASONS, RequestUpdate

logger = logging.getLogger(__name__)


class ProcessedStep(NamedTuple):
    """The outputs of one step, and the core requests the scheduler must now finish."""

    outputs: list[RequestOutput]
    stopped_ids: list[str]  # a stop string appeared in the text
    failed_ids: list[str]  # detokenizing raised, or a sibling of theirs failed


@dataclass
class _Sequence:
    """One core request: one of the n sequences of a client request."""

    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    last_token_s: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    is_finish_shown: bool = False  # an output has carried its finish_reason


@dataclass
class _Request:
    """One client request and its sequences' latest state."""

    prompt: str | None
    prompt_token_ids: list[int]
    times: RequestTimes  # of the request as a whole: its first and last token of any sample
    kind: OutputKind
    core_ids: list[str]
    num_cached_tokens: int = 0
    failure: RequestFailure | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    is_prompt_logprobs_shown: bool = False  # a DELTA output has carried them


class OutputProcessor:
    """Per-request detokenization state; the engine feeds it every step's updates."""

    def __init__(self, decode: DecodeFn, metrics: EngineMetrics) -> None:
        self._decode = decode
        self._metrics = metrics
        self._requests: dict[str, _Request] = {}  # by client request id
        self._sequences: dict[str, _Sequence] = {}  # by core request id

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        core_ids: list[str] | None = None,
        *,
        arrival_s: float | None = None,
    ) -> None:
        """`core_ids`: the ids of its n core requests, in index order (default: the request
        id itself, for n = 1). `arrival_s` (`time.monotonic()`, default now) is when the engine
        took the request: taken before the core could schedule it, so no queue time comes out
        negative."""
        core_ids = [request_id] if core_ids is None else list(core_ids)
        for index, core_id in enumerate(core_ids):
            detok = IncrementalDetokenizer(
                self._decode,
                params.stop,
                skip_special_tokens=params.skip_special_tokens,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            seq = _Sequence(request_id, index, detok)
            if params.logprobs is not None:
                seq.logprobs, seq.cumulative_logprob = [], 0.0
            self._sequences[core_id] = seq
        times = RequestTimes(time.monotonic() if arrival_s is None else arrival_s)
        self._requests[request_id] = _Request(
            prompt, prompt_token_ids, times, output_kind, core_ids
        )
        self._metrics.inc("prompt_tokens", len(prompt_token_ids))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def core_ids(self, request_id: str) -> list[str]:
        """The core request ids of a client request (the id itself when it is not tracked)."""
        request = self._requests.get(request_id)
        return [request_id] if request is None else list(request.core_ids)

    @property
    def request_ids(self) -> set[str]:
        """The core request ids still tracked (every unfinished sequence)."""
        return set(self._sequences)

    def process(self, updates: list[RequestUpdate]) -> ProcessedStep:
        """The outputs of this step; a request whose text cannot be made fails alone."""
        step = ProcessedStep([], [], [])
        now = time.monotonic()
        changed: dict[str, dict[int, CompletionOutput]] = {}
        for update in updates:
            seq = self._sequences.get(update.request_id)
            request = self._requests.get(seq.parent_id) if seq is not None else None
            if seq is None or request is None or request.failure is not None:
                continue
            completion = self._advance(seq, request, update, now, step)
            completions = changed.setdefault(seq.parent_id, {})
            # NOTE: a core in another process may deliver several of its steps at once, so a
            # sequence can have more than one update here: their deltas add up.
            earlier = completions.get(seq.index)
            completions[seq.index] = (
                completion
                if earlier is None
                else merge_completion(earlier, completion, request.kind)
            )
        for request_id, completions in changed.items():
            output = self._output(request_id, completions)
            if output is not None:
                step.outputs.append(output)
        return step

    def abort(self, request_id: str) -> RequestOutput | None:
        """Final output of a request aborted from outside the step (client gone, shutdown)."""
        return self._end(request_id, "abort", None)

    def fail(self, core_id: str, failure: RequestFailure) -> RequestOutput | None:
        """Final output of the request a core request belongs to, failed from outside the step
        (a failed engine step); None once that request has ended."""
        seq = self._sequences.get(core_id)
        return None if seq is None else self._end(seq.parent_id, "error", failure)

    # --------------------------------------------------------------------------- internals

    def _advance(
        self,
        seq: _Sequence,
        request: _Request,
        update: RequestUpdate,
        now: float,
        step: ProcessedStep,
    ) -> CompletionOutput:
        """Apply one update to its sequence; returns what this update added."""
        new_ids = update.new_token_ids
        if update.first_scheduled_time_s is not None:  # the first of its samples to be scheduled
            request.times.on_scheduled(update.first_scheduled_time_s)
        if new_ids:
            self._observe_latency(seq, request, now, len(new_ids))
        seq.token_ids.extend(new_ids)
        if seq.index == 0:
            # the first sample's hit is the prompt's (its siblings then hit what it computed)
            request.num_cached_tokens = update.num_cached_tokens
        if update.prompt_logprobs is not None and request.prompt_logprobs is None:
            entries, _ = decode_logprobs(update.prompt_logprobs, self._decode)
            request.prompt_logprobs = [None, *entries]
        finish_reason = FINISH_REASONS.get(update.finish_status) if update.finished else None
        seq.stop_reason = update.stop_reason
        failure = update.error
        delta_logprobs = self._add_logprobs(seq, update)
        try:
            delta = seq.detokenizer.add_tokens(new_ids)
        except Exception as exc:  # noqa: BLE001 - fails this request only; logged once
            logger.exception("request %s: detokenizing failed", update.request_id)
            delta, finish_reason, seq.stop_reason = "", "error", None
            failure = RequestFailure(
                f"detokenizing the output failed: {type(exc).__name__}", FailureKind.INTERNAL
            )
            step.failed_ids.append(update.request_id)
        if finish_reason is None and seq.detokenizer.stop_reason is not None:
            finish_reason, seq.stop_reason = "stop", seq.detokenizer.stop_reason
            step.stopped_ids.append(update.request_id)
        seq.finish_reason = finish_reason
        if failure is not None:
            request.failure = failure
            for sibling_id in request.core_ids:
                sibling = self._sequences.get(sibling_id)
                if sibling is not None and sibling.finish_reason is None:
                    sibling.finish_reason = "error"
                    step.failed_ids.append(sibling_id)
        return self._completion(seq, request.kind, delta, list(new_ids), delta_logprobs)

    def _add_logprobs(self, seq: _Sequence, update: RequestUpdate) -> list[TokenLogprobs] | None:
        if seq.logprobs is None:
            return None
        if update.logprobs is None:
            return []
        entries, total = decode_logprobs(update.logprobs, self._decode)
        seq.logprobs.extend(entries)
        seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + total
        return entries

    def _completion(
        self,
        seq: _Sequence,
        kind: OutputKind,
        delta_text: str,
        delta_ids: list[int],
        delta_logprobs: list[TokenLogprobs] | None,
    ) -> CompletionOutput:
        if kind is OutputKind.DELTA:
            text, token_ids, logprobs = delta_text, list(delta_ids), delta_logprobs
        else:
            text, token_ids = seq.detokenizer.text, list(seq.token_ids)
            logprobs = None if seq.logprobs is None else list(seq.logprobs)
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=token_ids,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            delta_text=delta_text,
            delta_token_ids=list(delta_ids),
            num_tokens=len(seq.token_ids),
            logprobs=logprobs,
            cumulative_logprob=seq.cumulative_logprob,
        )

    def _output(
        self, request_id: str, completions: dict[int, CompletionOutput]
    ) -> RequestOutput | None:
        """The request's output after this step's `completions`; None for a request that
        shows only its final output and has not finished."""
        request = self._requests[request_id]
        seqs = [self._sequences[core_id] for core_id in request.core_ids]
        finished = request.failure is not None or all(s.finish_reason for s in seqs)
        if not finished and request.kind is OutputKind.FINAL_ONLY:
            return None
        if request.kind is OutputKind.DELTA:
            # a sequence a sibling's failure ended shows its finish_reason once, like the rest
            for seq in seqs:
                if seq.finish_reason and not seq.is_finish_shown and seq.index not in completions:
                    completions[seq.index] = self._completion(seq, request.kind, "", [], [])
            outputs = [completions[i] for i in sorted(completions)]
        else:
            outputs = [
                completions.get(s.index) or self._completion(s, request.kind, "", [], None)
                for s in seqs
            ]
        for c in outputs:  # a sibling's failure later in the step ended this one too
            c.finish_reason = seqs[c.index].finish_reason
            seqs[c.index].is_finish_shown = c.finish_reason is not None
        prompt_logprobs = request.prompt_logprobs
        if request.kind is OutputKind.DELTA:
            if request.is_prompt_logprobs_shown:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                request.is_prompt_logprobs_shown = True
        output = RequestOutput(
            request_id=request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=request.num_cached_tokens,
            error=None if request.failure is None else request.failure.message,
            error_kind=None if request.failure is None else request.failure.kind,
            error_param=None if request.failure is None else request.failure.param,
            prompt_logprobs=prompt_logprobs,
        )
        if finished:
            self._forget(request_id)
        return output

    def _end(
        self, request_id: str, reason: str, failure: RequestFailure | None
    ) -> RequestOutput | None:
        request = self._requests.get(request_id)
        if request is None:
            return None
        if failure is not None:
            request.failure = failure
        completions: dict[int, CompletionOutput] = {}
        for core_id in request.core_ids:
            seq = self._sequences[core_id]
            if seq.finish_reason is None:
                seq.finish_reason = reason
                completions[seq.index] = self._completion(seq, request.kind, "", [], [])
        return self._output(request_id, completions)

    def _observe_latency(self, seq: _Sequence, request: _Request, now: float, num_new: int) -> None:
        times = request.times
        if times.first_token_s is None:
            self._metrics.observe_ttft(now - times.arrival_s)
        elif seq.last_token_s is not None:
            self._metrics.observe_itl((now - seq.last_token_s) / num_new)
        seq.last_token_s = now
        times.on_tokens(now)
        self._metrics.inc("generation_tokens", num_new)

    def _forget(self, request_id: str) -> None:
        """Drop a finished request and observe its phases, once per client request: its
        finish reason is its first sample's (error if any failed), its generated tokens all
        its samples' (what usage.completion_tokens sums)."""
        request = self._requests.pop(request_id)
        seqs = [self._sequences.pop(core_id, None) for core_id in request.core_ids]
        seqs = [seq for seq in seqs if seq is not None]
        failed = request.failure is not None
        self._metrics.inc("requests_failed" if failed else "requests_finished")
        first_reason = seqs[0].finish_reason if seqs else None
        reason = "error" if failed else (first_reason or "abort")
        num_generated = sum(len(seq.token_ids) for seq in seqs)
        stats = request.times.finished(
            time.monotonic(), reason, len(request.prompt_token_ids), num_generated
        )
        self._metrics.record_finished(stats)
