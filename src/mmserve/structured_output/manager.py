"""One grammar matcher per structured request, in the engine core: masks before, tokens after.

Per step: `grammar_output` fills one int32 row per sampling request that has a grammar (the
engine core hands it to the executor beside the step; the runner gives every other row all
ones); after sampling, `accept` feeds each such request the token
it got. The matcher therefore always holds exactly the request's generated tokens: a preempted
request keeps its outputs and its matcher, and its recompute samples nothing until it has
caught up, so nothing is fed twice.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

import llguidance
import llguidance.numpy
import numpy as np

from mmserve.errors import FailureKind, RequestFailure
from mmserve.scheduling.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from mmserve.scheduling.request import Request
from mmserve.structured_output.compiler import GrammarCompiler
from mmserve.structured_output.params import PARAM, StructuredOutputParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MaskResult:
    """The step's bitmask (None when no sampling row has a grammar) and the requests whose
    grammar cannot go on (they must fail this step instead of sampling)."""

    grammar_output: GrammarOutput | None
    failures: dict[str, RequestFailure] = field(default_factory=dict)


@dataclass(frozen=True)
class AcceptResult:
    """After sampling: requests whose grammar is complete (they finish "stop") and requests
    whose token the matcher refused."""

    completed: set[str] = field(default_factory=set)
    failures: dict[str, RequestFailure] = field(default_factory=dict)


class StructuredOutputManager:
    """Matchers by request id. `make_compiler` is called on first use: building the
    llguidance tokenizer of a large vocabulary costs time an unstructured server never pays.
    One thread (the engine core's) uses it."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler]) -> None:
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = self._make_compiler()
            self._executor = llguidance.LLExecutor()
        return self._compiler

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    def make_matcher(self, params: StructuredOutputParams) -> llguidance.LLMatcher:
        """Compile (or take from the cache); raises InvalidRequestError for a bad spec."""
        return self.compiler.make_matcher(params)

    def register(self, request_id: str, matcher: llguidance.LLMatcher) -> None:
        assert request_id not in self._matchers, request_id
        self._matchers[request_id] = matcher

    def free(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def retain(self, live_request_ids: Collection[str]) -> None:
        """Drop the matcher of every request that is no longer unfinished."""
        self.free([r for r in self._matchers if r not in live_request_ids])

    def grammar_output(self, so: SchedulerOutput, requests: Mapping[str, Request]) -> MaskResult:
        """The bitmask of the step's structured requests that sample (those whose step reaches
        the end of their tokens), and the requests whose grammar cannot go on."""
        if not self._matchers:
            return MaskResult(None)
        sampling = [
            r
            for r in so.num_scheduled_tokens
            if r in self._matchers
            and (request := requests.get(r)) is not None
            and request.num_computed_tokens >= request.num_tokens
        ]
        return self.bitmask(sampling)

    def accept_step(
        self, runner_output: ModelRunnerOutput, failures: Mapping[str, RequestFailure]
    ) -> tuple[ModelRunnerOutput, set[str]]:
        """Feed the sampled tokens to the matchers; `failures` (from `grammar_output`) and tokens a
        matcher refuses become errors of the runner output. Returns it with the requests
        whose grammar is now complete."""
        if not self._matchers and not failures:
            return runner_output, set()
        sampled, errors = runner_output.sampled_token_ids, runner_output.errors
        accepted = self.accept(
            {r: t for r, t in sampled.items() if r not in failures and r not in errors}
        )
        failed = {**failures, **accepted.failures}
        if not failed:
            return runner_output, accepted.completed
        errors = {**failed, **errors}
        kept = {r: t for r, t in sampled.items() if r not in errors}
        kept_output = dataclasses.replace(runner_output, sampled_token_ids=kept, errors=errors)
        return kept_output, accepted.completed - errors.keys()

    def bitmask(self, sampling_request_ids: Iterable[str]) -> MaskResult:
        """The allowed next tokens of each sampling request that has a grammar."""
        ids = [r for r in sampling_request_ids if r in self._matchers]
        if not ids:
            return MaskResult(None)
        vocab_size = self.compiler.tokenizer.vocab_size
        # [len(ids), ceil(vocab / 32)]: bit j of word w allows token 32 * w + j
        words = llguidance.numpy.allocate_token_bitmask(len(ids), vocab_size)
        matchers = [(self._matchers[r], i) for i, r in enumerate(ids)]
        assert self._executor is not None
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, matchers, words)
        failures: dict[str, RequestFailure] = {}
        allows_any = words.any(axis=1)  # [len(ids)]
        for i, request_id in enumerate(ids):
            matcher = self._matchers[request_id]
            if matcher.is_error():
                failures[request_id] = _matcher_failure(request_id, matcher)
            elif not allows_any[i]:
                failures[request_id] = RequestFailure(
                    "structured output: the grammar allows no next token (and the model may "
                    "not end here); check that the grammar can be completed",
                    FailureKind.REQUEST,
                    PARAM,
                )
        for i, request_id in enumerate(ids):
            if request_id in failures:
                words[i] = -1  # it fails instead of sampling: let its row sample anything
        return MaskResult(GrammarOutput(tuple(ids), np.ascontiguousarray(words)), failures)

    def accept(self, sampled_token_ids: Mapping[str, list[int]]) -> AcceptResult:
        """Feed each structured request the tokens it was given this step."""
        completed: set[str] = set()
        failures: dict[str, RequestFailure] = {}
        for request_id, tokens in sampled_token_ids.items():
            matcher = self._matchers.get(request_id)
            if matcher is None or not tokens:
                continue
            if not matcher.consume_tokens(tokens):
                failures[request_id] = _matcher_failure(request_id, matcher)
            elif matcher.is_stopped():
                completed.add(request_id)
        return AcceptResult(completed, failures)


def _matcher_failure(request_id: str, matcher: llguidance.LLMatcher) -> RequestFailure:
    error = matcher.get_error() or "the sampled token does not fit the grammar"
    logger.warning("request %s: structured output failed: %s", request_id, error[:500])
    return RequestFailure(f"structured output failed: {error[:500]}", FailureKind.REQUEST, PARAM)
