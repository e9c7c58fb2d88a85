"""OpenAI request bodies (chat and completions) with mmserve's per-request extensions."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mmserve.errors import InvalidRequestError


class _Body(BaseModel):
    # Unknown OpenAI fields (user, metadata, ...) are accepted and ignored, like OpenAI itself
    # does for fields a model does not use; fields that would change the answer are declared
    # below and refused when set to something we cannot honour.
    model_config = ConfigDict(extra="ignore")


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


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


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
    cache_salt: str | None = None
    logprobs: bool | int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    def check_unsupported(self) -> None:
        if self.logprobs:
            raise InvalidRequestError(
                "logprobs are not supported; omit 'logprobs'", param="logprobs"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise InvalidRequestError(
                    f"{name} is not supported; omit it or set it to 0", param=name
                )
        if self.cache_salt is not None and not self.cache_salt:
            raise InvalidRequestError("cache_salt must not be empty", param="cache_salt")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    multi_modal_uuids: dict[str, list[str | None]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools:
            raise InvalidRequestError("tool calling is not supported; omit 'tools'", param="tools")

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise InvalidRequestError("echo is not supported; omit 'echo'", param="echo")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported; omit 'suffix'", param="suffix")

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
