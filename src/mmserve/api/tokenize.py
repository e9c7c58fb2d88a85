"""POST /tokenize and /detokenize in vLLM's shapes.

/tokenize takes a prompt (`{model, prompt, add_special_tokens}`) or chat messages (`{model,
messages, add_generation_prompt, continue_final_message, chat_template_kwargs, ...}`) and
answers `{count, max_model_len, tokens, token_strs}`. Messages go through the chat
completion's own CPU stage (`EngineClient.process_chat`: template, media, image processing,
placeholder expansion), so `count` is exactly the `usage.prompt_tokens` a chat completion with
the same messages reports. /detokenize takes `{model, tokens}` and answers `{prompt}`.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mmserve.api.errors import validation_error
from mmserve.api.protocol import ChatMessage
from mmserve.api.tools import tool_request
from mmserve.engine.frontend.protocol import EngineClient, TextTokenizer
from mmserve.errors import InvalidRequestError

# The most ids one /detokenize may send (decoding is linear in them; the body cap also holds).
MAX_DETOKENIZE_TOKENS = 1 << 18
# Text longer than this is tokenized on a worker thread, off the event loop.
_ENCODE_IN_THREAD_CHARS = 1 << 16


class _Strict(BaseModel):
    # Every field is known: an unknown one is a 400 naming it, never silently ignored.
    model_config = ConfigDict(extra="forbid", strict=True)


class TokenizePromptRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Chat completions never add special tokens beyond the template's; only false is accepted
    # (True is refused below), so that count equals a chat completion's prompt_tokens.
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    multi_modal_uuids: dict[str, list[str | None]] | None = None
    tools: Any = None  # checked by api/tools.py, as chat's


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: Annotated[list[int], Field(max_length=MAX_DETOKENIZE_TOKENS)]


TokenizeRequest = TokenizePromptRequest | TokenizeChatRequest


def parse_tokenize_request(
    data: dict[str, Any], *, trust_request_chat_template: bool = False
) -> TokenizeRequest:
    """The prompt form or the chat form, told apart by `messages` (as vLLM does)."""
    model = TokenizeChatRequest if "messages" in data else TokenizePromptRequest
    body = _validated(model, data)
    if isinstance(body, TokenizeChatRequest):
        _refuse_chat_options(body, trust_request_chat_template)
    return body


def parse_detokenize_request(data: dict[str, Any]) -> DetokenizeRequest:
    body = _validated(DetokenizeRequest, data)
    assert isinstance(body, DetokenizeRequest)
    return body


def _validated(model: type[_Strict], data: dict[str, Any]) -> _Strict:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def _refuse_chat_options(body: TokenizeChatRequest, trust_request_chat_template: bool) -> None:
    if body.chat_template is not None and not trust_request_chat_template:
        raise InvalidRequestError(
            "chat_template is accepted only by a server started with "
            "--trust-request-chat-template (as chat completions); omit chat_template",
            param="chat_template",
        )
    if body.add_special_tokens:
        raise InvalidRequestError(
            "add_special_tokens: true is not supported with messages: chat completions add "
            "only the chat template's tokens, and /tokenize counts what they would; omit it",
            param="add_special_tokens",
        )


async def tokenize(engine: EngineClient, body: TokenizeRequest, namespace: str) -> dict[str, Any]:
    """The token ids a prompt (or a chat) becomes, exactly as generation would see them."""
    tokenizer = engine.tokenizer
    if isinstance(body, TokenizeChatRequest):
        # the tools as the chat template sees them (checked as chat checks them)
        tools = tool_request(body.tools, "none", None, enable_auto_tool_choice=False)
        prompt = await engine.process_chat(
            [m.model_dump(exclude_none=True) for m in body.messages],
            mm_processor_kwargs=body.mm_processor_kwargs,
            multi_modal_uuids=body.multi_modal_uuids,
            namespace=namespace,
            chat_template_kwargs=body.chat_template_kwargs,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template=body.chat_template,
            media_io_kwargs=body.media_io_kwargs,
            tools=tools.template_tools if tools is not None else None,
        )
        token_ids = list(prompt.prompt_token_ids)
    elif len(body.prompt) > _ENCODE_IN_THREAD_CHARS:
        token_ids = await asyncio.to_thread(
            tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens
        )
    else:
        token_ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    answer: dict[str, Any] = {
        "count": len(token_ids),
        "max_model_len": engine.max_model_len,
        "tokens": token_ids,
        "token_strs": None,
    }
    if body.return_token_strs:
        answer["token_strs"] = [tokenizer.id_to_token(t) or "" for t in token_ids]
    return answer


async def detokenize(engine: EngineClient, body: DetokenizeRequest) -> dict[str, Any]:
    """The text of token ids, special tokens included (so /tokenize's ids round-trip)."""
    tokenizer = engine.tokenizer
    _check_token_ids(body.tokens, tokenizer)
    text = await asyncio.to_thread(tokenizer.decode, body.tokens, skip_special_tokens=False)
    return {"prompt": text}


def _check_token_ids(token_ids: list[int], tokenizer: TextTokenizer) -> None:
    vocab = tokenizer.vocab_size
    for i, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab:
            raise InvalidRequestError(
                f"tokens[{i}] is {token_id}, outside the vocabulary [0, {vocab}); send token "
                "ids this model's tokenizer produced (see /tokenize)",
                param=f"tokens.{i}",
            )
