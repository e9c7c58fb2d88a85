"""The body of POST /v1/responses (OpenAI's Responses API), as far as this server serves it.

Every field is declared: one that is not is a 400 naming it. Fields that would change the
answer but are not implemented are declared with their no-op value and refused otherwise
(`NO_OP_FIELDS`); purely informational ones (`metadata`, `user`, ...) are accepted and echoed.
The input items themselves are checked where they become chat messages
(`api/responses.py: chat_messages`), so that each error names its `input[i]` path.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mmserve.api.protocol import MAX_CACHE_SALT_CHARS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextFormat(_Strict):
    """`text.format`: plain text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # pydantic reserves `schema`; the JSON key is still "schema"
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Stateless: refused unless false / null (api/responses.py says why).
    store: bool | None = None
    previous_response_id: str | None = None
    # Informational: accepted, echoed where the Response object has them, change nothing.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # Declared for NO_OP_FIELDS only (any other value is refused).
    background: bool | None = None
    truncation: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    # vLLM's extensions, with the meaning they have in chat completions.
    top_k: int | None = None
    seed: int | None = None
    min_tokens: int = 0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    mm_processor_kwargs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# field -> the values that change nothing (None always changes nothing); the first is the one
# the error message suggests.
NO_OP_FIELDS: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "truncation": ("disabled",),
    "include": ([],),
    "reasoning": ({},),
    "top_logprobs": (0,),
    "max_tool_calls": (),
    "prompt": (),
    "conversation": (),
    # OpenAI's obfuscation pads delta events against side channels; without it nothing changes
    "stream_options": ({}, {"include_obfuscation": False}, {"include_obfuscation": True}),
}

# Why each refused field is refused (the default: "not supported by this server").
REFUSAL_REASONS: dict[str, str] = {
    "background": "background responses need stored responses, which this server does not keep",
    "conversation": "conversations are server-side state, which this server does not keep",
    "prompt": "stored prompt templates are server-side state, which this server does not keep",
    "include": "no extra output data (logprobs, encrypted reasoning, ...) is available",
    "reasoning": "this model has no reasoning mode",
    "top_logprobs": "logprobs are not returned by this server's Responses API (use chat "
    "completions for logprobs)",
}
