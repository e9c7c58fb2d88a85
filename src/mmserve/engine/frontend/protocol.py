"""The front end's seams: what a server needs from an engine (`EngineClient`), and what the
front end drives (`CoreLike`: an engine core in this process or in an engine process)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Protocol

from mmserve.config.scheduler import CacheConfig, SchedulerConfig
from mmserve.engine.frontend.outputs import OutputKind, RequestOutput
from mmserve.engine.frontend.replicas import ReplicaState
from mmserve.metrics import EngineMetrics
from mmserve.multimodal import ProcessedPrompt
from mmserve.sampling_params import SamplingParams
from mmserve.updates import RequestStatus, RequestUpdate


class TextTokenizer(Protocol):
    """The checkpoint's tokenizer, as /tokenize and /detokenize use it."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def id_to_token(self, token_id: int) -> str | None: ...


class EngineClient(Protocol):
    """An engine running in the background that serves many concurrent requests.

    Contracts:
    - `process_chat` / `process_prompt` do the CPU stage (media fetch and decode, image
      processing, templating, tokenisation, placeholder expansion, identity) and raise
      `mmserve.errors.InvalidRequestError` subclasses for user mistakes. They do not touch the
      scheduler.
    - `generate` submits a processed prompt and yields `RequestOutput`s (cumulative, deltas or
      only the final one, as `output_kind` says), the last one with `finished=True`. Closing
      the iterator early (client gone) aborts the request and frees its KV blocks and
      encoder-cache references. A failure inside the engine that concerns only
      this request ends it with finish_reason "error", `error` set and `error_kind` saying
      whose fault it is (`mmserve.errors.FailureKind`); it never raises into other requests.
      A command the engine could not apply raises a typed error (`InvalidRequestError`, or
      `InternalRequestError` naming the request id) from the iterator.
    - When the engine has died, `is_healthy` is False and every method that needs it
      (`process_*`, `generate`, and iterators already running) raises `EngineDeadError` within
      a second instead of waiting.
    """

    model_name: str
    max_model_len: int
    max_logprobs: int  # --max-logprobs: the most top logprobs a request may ask for
    # SamplingParams fields for those a request leaves out (--generation-config)
    sampling_defaults: dict[str, Any]
    metrics: EngineMetrics
    tokenizer: TextTokenizer

    async def process_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        mm_processor_kwargs: dict[str, Any] | None = None,
        multi_modal_uuids: dict[str, list[str | None]] | None = None,
        namespace: str = "default",
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        media_io_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,  # OpenAI function tools, for the template
    ) -> ProcessedPrompt: ...

    def token_id(self, text: str) -> int | None:
        """The id of `text` when it is one token of the vocabulary (a tag the output parsers
        count by), else None."""
        ...

    async def process_prompt(
        self,
        prompt: str | list[int],
        *,
        namespace: str = "default",
    ) -> ProcessedPrompt: ...

    def generate(
        self,
        prompt: ProcessedPrompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        cache_salt: str | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def is_healthy(self) -> bool: ...

    def replica_states(self) -> list[ReplicaState]:
        """Each data-parallel replica's state (live or restarting); [] with one engine core."""
        ...

    def decode_tokens(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens shown (what `echo` shows of a prompt)."""
        ...

    async def shutdown(self, timeout_s: float = 20.0) -> None: ...


class CoreLike(Protocol):
    """What `LLMEngine` drives: an `EngineCore` here, or a client of one in another process."""

    dead_reason: str | None
    scheduler_config: SchedulerConfig  # what the front end admits requests against
    cache_config: CacheConfig

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> None: ...

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestUpdate]: ...

    def wake(self) -> None:
        """From any thread: a `step` that waits for outputs returns now (a request is ready to
        be sent). A no-op for a core whose `step` never waits."""
        ...

    def check_alive(self) -> None: ...

    def shutdown(self) -> None: ...
