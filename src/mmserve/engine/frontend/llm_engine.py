"""LLMEngine: the synchronous engine loop — core step (schedule, execute, update), then outputs."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from mmserve.engine.frontend.output_processor import OutputProcessor
from mmserve.engine.frontend.outputs import OutputKind, RequestOutput
from mmserve.engine.frontend.protocol import CoreLike
from mmserve.engine.frontend.replicas import ReplicaSet, ReplicaState
from mmserve.errors import EngineDeadError, FailureKind, InvalidRequestError, RequestFailure
from mmserve.metrics import EngineMetrics
from mmserve.multimodal import ProcessedPrompt
from mmserve.processing.input_processor import InputProcessor
from mmserve.sampling_params import INT64_MIN, SamplingParams, check_seed, resolve_max_tokens
from mmserve.scheduling.admission import validate_request
from mmserve.updates import RequestStatus

logger = logging.getLogger(__name__)

# The n core requests of a client request with n > 1 are "<request id>#<index>"; a client id
# may not contain the separator, so a child id can never equal another request's id.
CHILD_ID_SEPARATOR = "#"


class LLMEngine:
    """The front end of one engine core: prompts in, `RequestOutput`s (text) out.

    The core (scheduler + executor) runs in this process (`EngineCore`) or in an engine
    process (`engine.frontend.core_client.CoreClient`); this loop is the same for both. Not
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
        max_logprobs: int,
        sampling_defaults: Mapping[str, Any] | None = None,
    ) -> None:
        """`sampling_defaults`: SamplingParams fields (by name) for those a client request
        leaves out, from the checkpoint's generation_config.json (`--generation-config`)."""
        self.input_processor = input_processor
        self.core = core
        self.output_processor = output_processor
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.sampling_defaults: dict[str, Any] = dict(sampling_defaults or {})

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
        raises, nothing of the request is left behind.

        With `params.n > 1` the request runs as n core requests (children) of one prompt: the
        first computes the prompt's KV blocks and the others take them from the prefix cache
        (the scheduler defers a request whose next block is in flight); with a seed, child i
        samples with seed + i.
        """
        if CHILD_ID_SEPARATOR in request_id:
            raise ValueError(
                f"request id {request_id!r} contains {CHILD_ID_SEPARATOR!r}, which is reserved "
                "for the ids of parallel samples"
            )
        params = self._admit(prompt, params)
        params = with_bad_word_ids(params, self.input_processor.tokenizer.encode)
        core_ids = child_ids(request_id, params.n)
        added: list[str] = []
        # Before the core has it: an engine process may schedule it at once (queue time >= 0).
        arrival_s = time.monotonic()
        try:
            for core_id, child in zip(core_ids, child_params(params), strict=True):
                self.core.add_request(core_id, prompt, child, cache_salt=cache_salt)
                added.append(core_id)
            self.output_processor.add_request(
                request_id,
                prompt.prompt,
                prompt.prompt_token_ids,
                params,
                output_kind,
                core_ids,
                arrival_s=arrival_s,
            )
        except BaseException:
            self.core.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise

    def _admit(self, prompt: ProcessedPrompt, params: SamplingParams) -> SamplingParams:
        """Every check a request passes before any core sees it, once (its n children share
        the prompt and the limits): what the core could never run is refused here. Returns
        `params` with the max_tokens the core will honour (`resolve_max_tokens`)."""
        check_engine_limits(params, self.max_logprobs, self.input_processor.tokenizer.vocab_size)
        if params.seed is not None:
            check_seed(params.seed)  # past SamplingParams (a caller that bypassed it)
        scheduler_config = self.core.scheduler_config
        num_prompt = len(prompt.prompt_token_ids)
        max_tokens = resolve_max_tokens(
            num_prompt, params.max_tokens, scheduler_config.max_model_len
        )
        validate_request(
            num_prompt, max_tokens, prompt.mm_features, scheduler_config, self.core.cache_config
        )
        if max_tokens == params.max_tokens:
            return params
        return msgspec.structs.replace(params, max_tokens=max_tokens)

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        ids = list(request_ids)
        core_ids = [c for i in ids for c in self.output_processor.core_ids(i)]
        self.core.finish_requests(core_ids, RequestStatus.FINISHED_ABORTED)
        return [out for i in ids if (out := self.output_processor.abort(i)) is not None]

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    @property
    def dead_reason(self) -> str | None:
        """Why the core can no longer run, or None while it can."""
        return self.core.dead_reason

    def replica_states(self) -> list[ReplicaState]:
        """Each data-parallel replica's state; [] with one engine core."""
        return self.core.states() if isinstance(self.core, ReplicaSet) else []

    def check_alive(self) -> None:
        """Raise EngineDeadError if the core has died (called while idle)."""
        self.core.check_alive()

    def wake(self) -> None:
        """From any thread: end a core step that waits for outputs (`CoreLike.wake`)."""
        self.core.wake()

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


def child_ids(request_id: str, n: int) -> list[str]:
    """The core request ids of a client request: itself for n = 1."""
    if n == 1:
        return [request_id]
    return [f"{request_id}{CHILD_ID_SEPARATOR}{i}" for i in range(n)]


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per sample; child i of a seeded request uses seed + i (wrapped into
    the 64-bit range), so the samples differ and the whole request is reproducible. Only the
    first child computes prompt logprobs (the others' would be the same, and they may take
    its blocks from the prefix cache)."""
    if params.n == 1:
        return [params]
    out = []
    for i in range(params.n):
        seed = params.seed
        if seed is not None:
            seed = (seed + i - INT64_MIN) % 2**64 + INT64_MIN
        prompt_logprobs = params.prompt_logprobs if i == 0 else None
        out.append(msgspec.structs.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs))
    return out


def check_engine_limits(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """What SamplingParams cannot check alone: logprobs and prompt_logprobs against
    --max-logprobs, logit_bias and allowed_token_ids against the vocabulary."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise InvalidRequestError(
                f"{name} asks for {value} top logprobs but this server allows at most "
                f"{max_logprobs} (--max-logprobs); ask for fewer",
                param=name,
            )
    for name in ("logit_bias", "allowed_token_ids"):
        for token_id in getattr(params, name) or ():
            if token_id >= vocab_size:
                raise InvalidRequestError(
                    f"{name} names token id {token_id}, outside the vocabulary [0, {vocab_size})",
                    param=name,
                )


def with_bad_word_ids(params: SamplingParams, encode: Callable[[str], list[int]]) -> SamplingParams:
    """`params` with its bad words tokenized (vLLM's `update_from_tokenizer`): each word
    without and with a leading space, the second kept only when it is a different sequence of
    the same length (a space that merely adds a token adds no new word)."""
    if not params.bad_words:
        return params
    sequences: list[tuple[int, ...]] = []
    for word in params.bad_words:
        plain = tuple(encode(word.lstrip()))
        if not plain:
            raise InvalidRequestError(
                f"bad word {word[:40]!r} tokenizes to nothing", param="bad_words"
            )
        sequences.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return msgspec.structs.replace(params, bad_words_token_ids=tuple(sequences))
