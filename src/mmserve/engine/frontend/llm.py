"""The offline Python API: `LLM(model=DIR).generate(prompts, sampling_params)` and `.chat(...)`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from mmserve.config.engine import EngineConfig
from mmserve.config.resolved import ResolvedConfig
from mmserve.engine.factory import build_engine
from mmserve.engine.frontend.outputs import OutputKind, RequestOutput
from mmserve.hashing import DEFAULT_NAMESPACE
from mmserve.multimodal import ProcessedPrompt
from mmserve.processing.tokenizer import Tokenizer
from mmserve.sampling_params import SamplingParams

PromptInput = str | Mapping[str, Any]
PROGRESS_BAR_MIN_PROMPTS = 8


class LLM:
    """Runs a batch of prompts to completion in this process.

    Engine arguments are keyword arguments with the CLI's names (`max_num_batched_tokens=32`,
    `enable_prefix_caching=False`, ...). With no `model`, the bundled toy model is loaded.
    `multiprocess=True` runs the scheduler and the model in an engine process, as the server
    does; `shutdown()` (or leaving a `with LLM(...)` block) stops it.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        if model is not None:
            engine_args["model"] = str(model)
        self.engine_config = EngineConfig.from_kwargs(**engine_args)
        self.engine, self.resolved_config = build_engine(self.engine_config)
        self._ids = itertools.count()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the engine process (multiprocess) and release the engine. Idempotent."""
        self.engine.shutdown()

    @property
    def config(self) -> ResolvedConfig:
        return self.resolved_config

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate`/`chat` use when given no SamplingParams: the engine's defaults with
        the checkpoint's generation_config.json values over them (`generation_config="vllm"`
        keeps the engine's own), as vLLM's LLM does."""
        return SamplingParams(**self.engine.sampling_defaults)

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.input_processor.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Prompts are strings or {"prompt", "multi_modal_data", "mm_processor_kwargs",
        "multi_modal_uuids"} dicts; the prompt text carries the model's image markers."""
        if isinstance(prompts, str | Mapping):
            prompts = [prompts]
        processor = self.engine.input_processor
        processed = [
            processor.process_generate_input(p, namespace=DEFAULT_NAMESPACE) for p in prompts
        ]
        return self._run(processed, sampling_params, use_tqdm, cache_salt)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations. `tools` (OpenAI
        function tools) reach the chat template, as in vLLM's `LLM.chat`; the text comes back
        as generated (tool-call and reasoning parsing are the server's)."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        processor = self.engine.input_processor
        processed = [
            processor.process_chat(
                conv,
                mm_processor_kwargs=mm_processor_kwargs,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
            )
            for conv in conversations  # type: ignore[union-attr]
        ]
        return self._run(processed, sampling_params, use_tqdm, cache_salt)

    def _run(
        self,
        prompts: list[ProcessedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        cache_salt: str | None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} sampling params for {len(prompts)} prompts; "
                    "pass one, or one per prompt"
                )
        order: dict[str, int] = {}
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = tqdm(
            total=len(prompts),
            desc="Processed prompts",
            disable=not use_tqdm or len(prompts) < PROGRESS_BAR_MIN_PROMPTS,
        )
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                request_id = str(next(self._ids))
                self.engine.add_request(
                    request_id, prompt, p, cache_salt=cache_salt, output_kind=OutputKind.FINAL_ONLY
                )
                order[request_id] = i
            while any(r is None for r in results):
                if not self.engine.has_unfinished_requests():
                    # a bug, but a loop that cannot end must not spin forever
                    raise RuntimeError("the engine dropped a request without a final output")
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            self.engine.abort_requests([rid for rid, i in order.items() if results[i] is None])
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]
