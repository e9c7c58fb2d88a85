"""OpenAI request bodies (chat and completions) with mmserve's per-request extensions.

The models only check types (strictly: `"5"`, `5.0` and `true` are not integers); the ranges
of sampling fields are SamplingParams' (one rule for the server and the offline API), and
fields we do not implement are refused by `api/unsupported.py`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mmserve.api.structured_output import structured_output_from_fields
from mmserve.errors import InvalidRequestError
from mmserve.processing.chat import Role
from mmserve.sampling_params import SamplingParams

MAX_CACHE_SALT_CHARS = 1024


class _Body(BaseModel):
    # Unknown OpenAI fields (user, metadata, ...) are accepted and ignored, like OpenAI itself
    # does for fields a model does not use; fields that would change the answer are refused
    # by api/unsupported.py unless they hold their no-op value. Strict: pydantic's lax mode
    # would read "yes" as true and true as the integer 1.
    model_config = ConfigDict(extra="ignore", strict=True)


class ImageURL(_Body):
    url: str | None = None
    uuid: str | None = None
    detail: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL
    uuid: str | None = None


class VideoURL(_Body):
    url: str | None = None
    uuid: str | None = None


class VideoPart(_Body):
    type: Literal["video_url"]
    video_url: VideoURL
    uuid: str | None = None


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class ChatMessage(_Body):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn's calls, and the id a tool result answers (processing/chat.py checks
    # them and passes them to the chat template).
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class SamplingFields(_Body):
    """Sampling and stopping fields shared by both endpoints (OpenAI + vLLM extensions)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    # {token id as a string: bias}; the ids are checked by SamplingParams and the engine
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0)] | None = None
    # vLLM's: prompt_token_ids and token_ids in the answer
    return_token_ids: bool | None = None
    # Declared for its range only; any value other than the no-op one is refused as
    # unsupported (api/unsupported.py), after the range check.
    best_of: Annotated[int, Field(ge=1)] | None = None
    # Structured output (api/structured_output.py reads them; at most one may be set).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field the client bounded the output with (chat also has max_completion_tokens)."""
        return "max_tokens"

    @property
    def requested_logprobs(self) -> int | None:
        """How many top logprobs per token (None: no logprobs); each endpoint spells it."""
        return None

    @property
    def logprobs_field(self) -> str:
        return "logprobs"

    @property
    def requested_prompt_logprobs(self) -> int | None:
        """How many top logprobs per prompt token (None: none)."""
        return self.prompt_logprobs

    def token_logit_bias(self) -> dict[int, float] | None:
        """logit_bias with its keys as token ids; a key that is not an integer is a 400."""
        if self.logit_bias is None:
            return None
        out: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            if not re.fullmatch(r"-?[0-9]{1,10}", key):
                raise InvalidRequestError(
                    f'logit_bias keys must be token ids (integers as strings, e.g. "1234"), '
                    f"got {key[:40]!r}",
                    param="logit_bias",
                )
            out[int(key)] = bias
        return out

    def to_sampling_params(
        self, max_tokens: int | None, defaults: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        """The engine's SamplingParams; range errors name the field this request used.

        `defaults` (the checkpoint's generation_config.json, by SamplingParams field name)
        fill temperature, top_p, top_k and repetition_penalty where the request has none.
        """
        defaults = defaults or {}

        def pick(value: Any, name: str, fallback: Any) -> Any:
            return defaults.get(name, fallback) if value is None else value

        try:
            return SamplingParams(
                n=self.n,
                temperature=pick(self.temperature, "temperature", 1.0),
                top_p=pick(self.top_p, "top_p", 1.0),
                top_k=pick(self.top_k, "top_k", 0),
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=() if self.stop is None else self.stop,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                structured_outputs=structured_output_from_fields(self),
                logprobs=self.requested_logprobs,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=pick(self.repetition_penalty, "repetition_penalty", 1.0),
                logit_bias=self.token_logit_bias(),
                min_p=pick(self.min_p, "min_p", 0.0),
                allowed_token_ids=None
                if self.allowed_token_ids is None
                else tuple(self.allowed_token_ids),
                bad_words=tuple(self.bad_words or ()),
                prompt_logprobs=self.requested_prompt_logprobs,
            )
        except InvalidRequestError as exc:
            if exc.param == "logprobs" and self.logprobs_field != "logprobs":
                raise InvalidRequestError(
                    exc.message.replace("logprobs", self.logprobs_field, 1),
                    param=self.logprobs_field,
                ) from None
            field = self.max_tokens_field
            if field == "max_tokens":
                raise
            # SamplingParams speaks of max_tokens; this client sent max_completion_tokens.
            message = re.sub(r"\bmax_tokens\b", field, exc.message)
            param = field if exc.param == "max_tokens" else exc.param
            raise InvalidRequestError(message, param=param) from None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None  # vLLM's; its video fps and num_frames
    multi_modal_uuids: dict[str, list[str | None]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # with --trust-request-chat-template only
    add_generation_prompt: bool | None = None  # None: true
    continue_final_message: bool | None = None
    # Checked by api/tools.py, which names the field at fault.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0)] | None = None

    @property
    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError(
                    "top_logprobs needs logprobs: true; send both, or omit top_logprobs",
                    param="top_logprobs",
                )
            return None
        return self.top_logprobs or 0

    @property
    def logprobs_field(self) -> str:
        return "top_logprobs"

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def render_choice(self) -> tuple[bool, bool]:
        """(add_generation_prompt, continue_final_message); as in vLLM, continuing needs
        add_generation_prompt: false (it defaults to true), else the render is a 400."""
        return self.add_generation_prompt is not False, bool(self.continue_final_message)

    @property
    def response_role(self) -> str:
        """vLLM's: the assistant's, or without a generation prompt the last message's role."""
        if self.add_generation_prompt is False:
            return self.messages[-1].role
        return "assistant"


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool | None = None  # the prompt before the completion (and its logprobs with logprobs)

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def requested_prompt_logprobs(self) -> int | None:
        # vLLM: echo with logprobs returns the prompt's logprobs at the same K
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (batched prompts are refused)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequestError(
                    f"send one prompt per request (got {len(prompt)}); "
                    "batched prompts are not supported",
                    param="prompt",
                )
            prompt = prompt[0]
        if isinstance(prompt, list | str) and len(prompt) == 0:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return prompt  # type: ignore[return-value]
