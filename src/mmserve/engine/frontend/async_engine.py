"""AsyncLLMEngine: the engine loop on a background thread, one output stream per request."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from mmserve.config.engine import EngineConfig
from mmserve.config.media import SERVER_DECODE_WORKERS
from mmserve.config.resolved import ResolvedConfig
from mmserve.engine.factory import build_engine
from mmserve.engine.frontend.llm_engine import LLMEngine
from mmserve.engine.frontend.output_stream import OutputStream
from mmserve.engine.frontend.outputs import OutputKind, RequestOutput
from mmserve.errors import (
    EngineDeadError,
    InternalRequestError,
    InvalidRequestError,
    MMServeError,
    ServerShuttingDownError,
)
from mmserve.hashing import DEFAULT_NAMESPACE
from mmserve.host_allocator import limit_malloc_arenas
from mmserve.multimodal import ProcessedPrompt
from mmserve.processing.chat import check_media_uuid
from mmserve.processing.mrope import decode_positions
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
# How often a waiting request checks that the engine thread is still there. The thread tells
# every stream when it dies; this covers a death that could not (the stream must not hang).
LIVENESS_CHECK_S = 0.5


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    cache_salt: str | None
    output_kind: OutputKind


@dataclass(frozen=True)
class _Abort:
    request_id: str


class AsyncLLMEngine:
    """Implements `mmserve.engine.frontend.protocol.EngineClient` over one `LLMEngine`.

    Only the engine thread touches the LLMEngine; other threads talk to it through a queue of
    commands (add, abort), so the event loop never waits for a model step. A command or step
    that fails a request never stops the thread; if the engine dies (EngineDeadError, or a bug
    in this loop), every waiting request and every new one gets EngineDeadError at once.
    """

    def __init__(
        self,
        engine: LLMEngine,
        resolved: ResolvedConfig,
        *,
        model_name: str,
        on_dead: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        # Called once, from the engine thread, when the engine has died (the server exits).
        self.on_dead = on_dead
        self.resolved = resolved
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.max_logprobs = engine.max_logprobs
        self.sampling_defaults = engine.sampling_defaults
        self.metrics = engine.metrics
        self.replica_states = engine.replica_states  # read from any thread (for /health)
        self.tokenizer = engine.input_processor.tokenizer
        self._commands: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}
        self._streams_lock = threading.Lock()
        self._stop = threading.Event()
        self._accepting = True
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mmserve-engine", daemon=True)
        self._thread.start()

    def describe(self) -> dict[str, Any]:
        return self.resolved.as_dict()

    # ------------------------------------------------------------------ CPU stage (no engine)

    async def process_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        mm_processor_kwargs: dict[str, Any] | None = None,
        multi_modal_uuids: dict[str, list[str | None]] | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        media_io_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> ProcessedPrompt:
        self._raise_if_dead()  # no media fetch or decode for a request that cannot run
        if multi_modal_uuids:
            messages = _apply_uuids(messages, multi_modal_uuids)
        return await self.engine.input_processor.aprocess_chat(
            messages,
            mm_processor_kwargs=mm_processor_kwargs,
            namespace=namespace,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            media_io_kwargs=media_io_kwargs,
            tools=tools,
        )

    def token_id(self, text: str) -> int | None:
        return self.engine.input_processor.tokenizer.token_to_id(text)

    async def process_prompt(
        self, prompt: str | list[int], *, namespace: str = DEFAULT_NAMESPACE
    ) -> ProcessedPrompt:
        self._raise_if_dead()
        processor = self.engine.input_processor
        if isinstance(prompt, str):
            processor.check_prompt_text(prompt)
            return await asyncio.to_thread(processor.process, prompt, namespace=namespace)
        vocab = processor.tokenizer.vocab_size
        reserved = set(dataclasses.astuple(processor.token_ids))
        for tok in prompt:
            if not isinstance(tok, int) or not 0 <= tok < vocab:
                raise InvalidRequestError(
                    f"token id {tok!r} is outside the vocabulary [0, {vocab})"
                )
            if tok in reserved:
                raise InvalidRequestError(
                    f"token id {tok} is a vision token; send images as image_url content parts"
                )
        # its length is admission's to check (`LLMEngine.add_request`), as for any prompt;
        # its text (special tokens shown) is what `echo` prepends
        text = processor.tokenizer.decode(prompt, skip_special_tokens=False)
        return ProcessedPrompt(list(prompt), [], decode_positions(0, len(prompt), 0), 0, text)

    # ------------------------------------------------------------------------- generation

    async def generate(
        self,
        prompt: ProcessedPrompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        cache_salt: str | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> AsyncIterator[RequestOutput]:
        if not self._accepting:
            raise ServerShuttingDownError()
        stream = OutputStream(asyncio.get_running_loop(), output_kind)
        with self._streams_lock:
            # checked under the lock the dying thread takes to tell every stream: either this
            # stream is told or the death is seen here
            self._raise_if_dead()
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
        self._command(_Add(request_id, prompt, sampling_params, cache_salt, output_kind))
        finished = False
        try:
            while True:
                item = await self._next_item(stream)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._command(_Abort(request_id))
            with self._streams_lock:
                self._streams.pop(request_id, None)

    async def _next_item(self, stream: OutputStream) -> RequestOutput | BaseException:
        while True:
            try:
                async with asyncio.timeout(LIVENESS_CHECK_S):
                    return await stream.get()
            except TimeoutError:
                self._raise_if_dead()

    async def abort(self, request_id: str) -> None:
        self._command(_Abort(request_id))

    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def decode_tokens(self, token_ids: list[int]) -> str:
        return self.engine.input_processor.tokenizer.decode(token_ids, skip_special_tokens=False)

    def _command(self, command: _Add | _Abort) -> None:
        """Queue a command for the engine thread and end its wait for a step's outputs."""
        self._commands.put(command)
        self.engine.wake()

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(_dead_reason(self._error))
        if self._accepting and not self._thread.is_alive():
            raise EngineDeadError("the engine thread is gone")

    async def shutdown(self, timeout_s: float = 20.0) -> None:
        """Stop accepting, let running requests finish for up to timeout_s, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with self._streams_lock:
            remaining = list(self._streams)
        for request_id in remaining:
            self._command(_Abort(request_id))
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 5.0)
        await asyncio.to_thread(self.engine.shutdown)
        self.engine.input_processor.media_loader.close()

    # ------------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self.engine.check_alive()  # a core in another process can die idle
                    self._wait_for_command()
                    continue
                self._deliver_step(self.engine.step())  # raises only when the engine is dead
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request
            if not isinstance(exc, EngineDeadError):  # the engine has logged its own death
                logger.exception("engine loop crashed")
            with self._streams_lock:
                self._error = exc
                streams = list(self._streams.values())
            for stream in streams:
                stream.put(EngineDeadError(_dead_reason(exc)))
            if self.on_dead is not None and not self._stop.is_set():
                self.on_dead(_dead_reason(exc))

    def _wait_for_command(self) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S)
        except queue.Empty:
            return
        self._apply(command)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self._apply(command)

    def _apply(self, command: _Add | _Abort) -> None:
        """Apply one command; whatever it raises concerns that request only."""
        with self._streams_lock:
            stream = self._streams.get(command.request_id)
        try:
            if isinstance(command, _Abort):
                self._deliver_step(self.engine.abort_requests([command.request_id]))
            elif stream is not None:  # else the client left before the engine saw it
                self.engine.add_request(
                    command.request_id,
                    command.prompt,
                    command.params,
                    cache_salt=command.cache_salt,
                    output_kind=command.output_kind,
                )
        except EngineDeadError:
            raise
        except MMServeError as exc:
            if stream is not None:
                stream.put(exc)
        except Exception:  # noqa: BLE001 - a bug met by this request: it fails alone
            kind = "abort" if isinstance(command, _Abort) else "add"
            logger.exception("request %s: %s failed", command.request_id, kind)
            if stream is not None:
                stream.put(InternalRequestError(command.request_id))

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """Outputs (a step's, or an abort's), with one wake-up of each event loop that waits on
        some of them (not one per output: each wake-up is a write to the loop's self-pipe)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, RequestOutput]]] = {}
        with self._streams_lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream, out))
        for loop, batch in batches.items():
            # RuntimeError: the client's loop is closed, nobody is listening any more
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[OutputStream, RequestOutput]]) -> None:
    for stream, item in batch:
        stream.push(item)


def _dead_reason(exc: BaseException) -> str:
    return exc.reason if isinstance(exc, EngineDeadError) else f"{type(exc).__name__} in its loop"


def _apply_uuids(
    messages: list[dict[str, Any]], uuids: dict[str, list[str | None]]
) -> list[dict[str, Any]]:
    """Copy `multi_modal_uuids={"image": [...], "video": [...]}` onto the parts, in order."""
    unknown = set(uuids) - {"image", "video"}
    if unknown:
        raise InvalidRequestError(
            f"multi_modal_uuids has unsupported modalities {sorted(unknown)}; only 'image' "
            "and 'video'",
            param="multi_modal_uuids",
        )
    pending = {m: list(uuids.get(m) or []) for m in ("image", "video")}
    seen = dict.fromkeys(pending, 0)
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            modality = {"image_url": "image", "video_url": "video"}.get(kind or "")
            if modality is not None and seen[modality] < len(pending[modality]):
                k = seen[modality]
                uuid = pending[modality][k]
                seen[modality] += 1
                if uuid is not None:
                    where = f"multi_modal_uuids.{modality}[{k}]"
                    check_media_uuid(uuid, where, "multi_modal_uuids")
                    media_url = dict(part.get(kind) or {})
                    media_url.setdefault("uuid", uuid)
                    part = {**part, kind: media_url}
            elif modality is not None:
                seen[modality] += 1
            parts.append(part)
        out.append({**message, "content": parts})
    for modality, given in pending.items():
        if given and seen[modality] != len(given):
            raise InvalidRequestError(
                f"multi_modal_uuids has {len(given)} {modality} entries but the messages have "
                f"{seen[modality]} {modality}s; give one entry (or null) per {modality}",
                param="multi_modal_uuids",
            )
    return out


def build_async_engine(config: EngineConfig) -> AsyncLLMEngine:
    """The server's engine: its core in an engine process unless `--no-multiprocess`."""
    # Before the serving threads exist (see mmserve/host_allocator.py). Only the
    # server: it processes pictures on many threads, and the offline API measured ~5% slower
    # with the cap.
    limit_malloc_arenas()
    if config.parallel.multiprocess is None:
        config = dataclasses.replace(
            config, parallel=dataclasses.replace(config.parallel, multiprocess=True)
        )
    engine, resolved = build_engine(config, decode_workers=SERVER_DECODE_WORKERS)
    return AsyncLLMEngine(engine, resolved, model_name=config.checkpoint.resolved_served_model_name)
