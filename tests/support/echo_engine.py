"""A small real EngineClient for API tests: it "generates" by echoing the prompt's bytes.

Tokenisation is one token per UTF-8 byte of the concatenated text parts; each image adds
IMAGE_TOKENS placeholder ids. Generated token i is prompt token i (cycling), decoded as its
byte ("" for placeholders), so every expected answer is computable from the request alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from mmserve.engine.frontend.outputs import CompletionOutput, OutputKind, RequestOutput
from mmserve.errors import FailureKind, InvalidRequestError, MediaError
from mmserve.metrics import EngineMetrics
from mmserve.multimodal import ProcessedPrompt
from mmserve.sampling_params import SamplingParams

IMAGE_TOKEN_ID = 300
IMAGE_TOKENS = 4
FAIL_MARKER = "FAIL-IN-ENGINE"  # fails at the second token
FAIL_NOW_MARKER = "FAIL-AT-ONCE"  # fails at the first token
CRASH_MARKER = "CRASH-IN-PROCESSING"  # an engine bug: process_chat raises a plain exception
INTERNAL_MARKER = "FAIL-INTERNALLY"  # the engine fails the request at the second token, not
# because of its content (a bug, the device)
KNOWN_PROCESSOR_KWARGS = {"max_pixels", "min_pixels"}


class ByteTokenizer:
    """One token per UTF-8 byte; IMAGE_TOKEN_ID is the one special token (decoded as "")."""

    vocab_size = IMAGE_TOKEN_ID + 1

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in token_ids if i < 256).decode(errors="replace")

    def id_to_token(self, token_id: int) -> str | None:
        if token_id == IMAGE_TOKEN_ID:
            return "<image>"
        return bytes([token_id]).decode("latin-1") if 0 <= token_id < 256 else None


class EchoEngine:
    """Deterministic engine with per-token sleeps; records namespaces, aborts and shutdown."""

    def __init__(self, *, max_model_len: int = 64, token_delay_s: float = 0.0) -> None:
        self.model_name = "echo"
        self.max_model_len = max_model_len
        self.max_logprobs = 20
        self.sampling_defaults: dict = {}
        self.metrics = EngineMetrics()
        self.tokenizer = ByteTokenizer()
        # (add_generation_prompt, continue_final_message) as each process_chat received them
        self.chat_flags: list[tuple[bool, bool]] = []
        self.token_delay_s = token_delay_s
        self.namespaces: list[str] = []
        self.sampling_params: list[SamplingParams] = []  # as each generate() received them
        self.output_kinds: list[OutputKind] = []
        self.aborted: set[str] = set()
        self.finished: set[str] = set()
        self.running: set[str] = set()
        self.healthy = True
        self.shutdown_calls = 0
        self.metrics.set_gauge("kv_blocks_total", 16)
        self.metrics.set_gauge("kv_blocks_free", 16)

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
        tools: list[dict[str, Any]] | None = None,
    ) -> ProcessedPrompt:
        self.namespaces.append(namespace)
        self.chat_flags.append((add_generation_prompt, continue_final_message))
        if media_io_kwargs:
            raise InvalidRequestError("the echo engine has no media", param="media_io_kwargs")
        if tools:  # the echo has no template: the tools read as a system turn
            messages = [{"role": "system", "content": json.dumps(tools)}, *messages]
        unknown = set(mm_processor_kwargs or {}) - KNOWN_PROCESSOR_KWARGS
        if unknown:
            raise InvalidRequestError(
                f"unknown mm_processor_kwargs {sorted(unknown)}", param="mm_processor_kwargs"
            )
        ids: list[int] = []
        for message in messages:
            content = message.get("content") or ""
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            for part in parts:
                if part["type"] == "text":
                    if CRASH_MARKER in part["text"]:
                        raise RuntimeError("internal detail /srv/secret/path")
                    ids.extend(part["text"].encode())
                    continue
                url = part["image_url"].get("url") or ""
                if not url.startswith("data:image/"):
                    raise MediaError(f"cannot read image {url[:20]!r}", param="messages")
                ids.extend([IMAGE_TOKEN_ID] * IMAGE_TOKENS)
        return ProcessedPrompt(prompt_token_ids=ids)

    async def process_prompt(
        self, prompt: str | list[int], *, namespace: str = "default"
    ) -> ProcessedPrompt:
        self.namespaces.append(namespace)
        ids = list(prompt.encode()) if isinstance(prompt, str) else list(prompt)
        if any(not 0 <= i < 256 for i in ids):
            raise InvalidRequestError("token ids must be in [0, 256)", param="prompt")
        return ProcessedPrompt(prompt_token_ids=ids)

    async def generate(
        self,
        prompt: ProcessedPrompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        cache_salt: str | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> AsyncIterator[RequestOutput]:
        self.sampling_params.append(sampling_params)
        self.output_kinds.append(output_kind)
        sent_text = ""
        ids = prompt.prompt_token_ids
        text_so_far = bytes(i for i in ids if i < 256).decode(errors="replace")
        self._admit(request_id, len(ids))
        start = time.monotonic()
        out_ids: list[int] = []
        done = False
        try:
            assert sampling_params.max_tokens is not None
            while True:
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                else:
                    await asyncio.sleep(0)
                out_ids.append(ids[len(out_ids) % len(ids)])
                if len(out_ids) == 1:
                    self.metrics.observe_ttft(time.monotonic() - start)
                self.metrics.inc("generation_tokens")
                text = bytes(i for i in out_ids if i < 256).decode(errors="replace")
                reason, error, kind = None, None, None
                if (FAIL_MARKER in text_so_far and len(out_ids) >= 2) or (
                    FAIL_NOW_MARKER in text_so_far
                ):
                    reason, error = "error", "the engine could not place the image embeddings"
                    kind = FailureKind.REQUEST
                elif INTERNAL_MARKER in text_so_far and len(out_ids) >= 2:
                    reason, error = "error", "sampling failed: RuntimeError at /srv/secret/path"
                    kind = FailureKind.INTERNAL
                elif any(s in text for s in sampling_params.stop):
                    reason = "stop"
                elif len(out_ids) >= sampling_params.max_tokens:
                    reason = "length"
                done = reason is not None
                delta, sent_text = text[len(sent_text) :], text
                if output_kind is OutputKind.DELTA:
                    completion = CompletionOutput(0, delta, out_ids[-1:], finish_reason=reason)
                else:
                    completion = CompletionOutput(0, text, list(out_ids), finish_reason=reason)
                completion.delta_text, completion.num_tokens = delta, len(out_ids)
                if done or output_kind is not OutputKind.FINAL_ONLY:
                    yield RequestOutput(
                        request_id, None, ids, [completion], done, error=error, error_kind=kind
                    )
                if done:
                    return
        finally:
            self._release(request_id, aborted=not done)

    def _admit(self, request_id: str, num_prompt_tokens: int) -> None:
        self.running.add(request_id)
        self.metrics.inc("prompt_tokens", num_prompt_tokens)
        self._update_gauges()

    def _release(self, request_id: str, *, aborted: bool) -> None:
        self.running.discard(request_id)
        (self.aborted if aborted else self.finished).add(request_id)
        self.metrics.inc("requests_finished")
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.set_gauge("num_requests_running", len(self.running))
        self.metrics.set_gauge("kv_blocks_free", 16 - len(self.running))

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def token_id(self, text: str) -> int | None:
        """One token per UTF-8 byte: only a one-byte text is a token."""
        raw = text.encode()
        return raw[0] if len(raw) == 1 else None

    def is_healthy(self) -> bool:
        return self.healthy

    def replica_states(self) -> list:
        return []  # one engine core

    def decode_tokens(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode(errors="replace")

    async def shutdown(self, timeout_s: float = 20.0) -> None:
        self.shutdown_calls += 1
