"""Request fields that would change the answer but that mmserve does not implement.

A client that sends `length_penalty: 2` and gets an answer that
silently ignored it has been misled; so each such field is a 400 naming it, unless
it holds its no-op value. Purely informational fields (`user`, `metadata`, `store`,
`service_tier`, ...) are not listed: ignoring them changes nothing.
"""

from __future__ import annotations

import json
from typing import Any

from mmserve.errors import InvalidRequestError

# field (dotted for a nested one) -> the values that change nothing; null always changes nothing.
# The first value is the one the error message suggests. OpenAI fields first, then the vLLM
# extensions a vLLM client sends.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "functions": ([],),  # the deprecated spelling of tools (send tools)
    "function_call": ("none", "auto"),
    "audio": (),
    "modalities": (["text"],),
    "echo": (False,),
    "suffix": ("",),
    "stream_options.continuous_usage_stats": (False,),
    "length_penalty": (1,),
    "use_beam_search": (False,),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "structural_tag": (),
    "logits_processors": ([],),
    "truncate_prompt_tokens": (),
    "continue_final_message": (False,),
    "add_generation_prompt": (True,),
    "chat_template": (),
    "documents": ([],),
    "return_tokens_as_token_ids": (False,),
    "prompt_embeds": (),
    "add_special_tokens": (False,),
    "spaces_between_special_tokens": (True,),
    "priority": (0,),
    "vllm_xargs": ({},),
}


def refuse_unsupported_fields(
    body: dict[str, Any], supported: frozenset[str] = frozenset()
) -> None:
    """Raise InvalidRequestError for the first listed field that holds a value that matters;
    `supported`: the listed fields this endpoint implements (`echo` on completions only)."""
    for field, neutral in UNSUPPORTED_FIELDS.items():
        if field in supported:
            continue
        value = _lookup(body, field)
        if value is None or any(same_json_value(value, n) for n in neutral):
            continue
        if field == "best_of" and same_json_value(value, body.get("n", 1)):
            continue  # best_of == n returns every sample drawn: what n alone does
        hint = f"omit it or send {json.dumps(neutral[0])}" if neutral else "omit it"
        if field == "chat_template":
            hint = "omit it, or start the server with --trust-request-chat-template (as in vLLM)"
        raise InvalidRequestError(
            f"{field} is not supported by this server, and ignoring it would change the "
            f"answer; {hint}",
            param=field,
        )


def _lookup(body: dict[str, Any], dotted: str) -> Any:
    value: Any = body
    for key in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def same_json_value(value: Any, neutral: Any) -> bool:
    # In Python True == 1 and False == 0; in JSON they are different values.
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, int | float) and isinstance(neutral, int | float):
        return value == neutral
    return type(value) is type(neutral) and value == neutral
