"""The checkpoint's tokenizer (tokenizers library) and its Jinja chat template (sandboxed)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mmserve.errors import InvalidRequestError


def _token_str(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _load_chat_template(model_dir: Path, tokenizer_config: dict) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    json_file = model_dir / "chat_template.json"
    if json_file.is_file():
        return json.loads(json_file.read_text()).get("chat_template")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


# Names the renderer passes to the template itself (or that would smuggle a refused feature in,
# like tools); chat_template_kwargs may not set them.
RESERVED_TEMPLATE_ARGS = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "tools"}
    | {"documents", "continue_final_message", "chat_template"}
)
_MAX_KWARG_DEPTH = 32
MAX_REQUEST_TEMPLATE_CHARS = 64 * 1024


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(f"chat template refused the messages: {message}")


class Tokenizer:
    """Encode/decode with the checkpoint's tokenizer.json and render its chat template."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        bos_token: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.eos_token = eos_token
        self.bos_token = bos_token
        self.eos_token_id = self.token_to_id(eos_token) if eos_token else None
        self.pad_token_id = self.token_to_id(pad_token) if pad_token else None
        stop = [self.eos_token_id] if self.eos_token_id is not None else []
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*stop, *extra_eos_token_ids]))
        self._env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        self._env.globals["raise_exception"] = _raise_exception
        # Hugging Face's tojson (tool schemas, call arguments): plain JSON, no HTML escaping.
        self._env.filters["tojson"] = _tojson
        self._template = self._env.from_string(chat_template) if chat_template else None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        extra: list[int] = []
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            extra = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(
            tok,
            chat_template=_load_chat_template(model_dir, config),
            eos_token=_token_str(config.get("eos_token")),
            pad_token=_token_str(config.get("pad_token")),
            bos_token=_token_str(config.get("bos_token")),
            extra_eos_token_ids=extra,
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text; special-token strings in it become their ids (as in HF).

        `add_special_tokens`: also what the tokenizer's post-processor adds (a BOS, for
        tokenizers that have one; nothing for Qwen's)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def _compiled(self, chat_template: str) -> Template:
        """A request's template, compiled in the same sandbox as the model's."""
        if not isinstance(chat_template, str) or len(chat_template) > MAX_REQUEST_TEMPLATE_CHARS:
            raise InvalidRequestError(
                f"chat_template must be a string of at most {MAX_REQUEST_TEMPLATE_CHARS} "
                "characters",
                param="chat_template",
            )
        try:
            return self._env.from_string(chat_template)
        except Exception:  # noqa: BLE001 - the library's text is not the client's business
            raise InvalidRequestError(
                "chat_template is not a valid Jinja template", param="chat_template"
            ) from None

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render messages (already normalised by `processing.chat`) with the chat template.

        `template_kwargs` (the request's chat_template_kwargs) are extra template variables,
        e.g. {"add_vision_id": true}; they may not set what the renderer passes itself.
        `continue_final_message` ends the prompt right after the last message's text (no
        end-of-turn, no generation prompt), as Hugging Face's `apply_chat_template` does.
        `chat_template` (a request's own, which the server must trust) replaces the model's.
        `tools` (OpenAI function tools) reach the template as `tools`, as in Hugging Face.
        """
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidRequestError(
                    "continue_final_message and add_generation_prompt cannot both be true; "
                    "send add_generation_prompt: false",
                    param="continue_final_message",
                )
            rendered = self.apply_chat_template(
                messages,
                add_generation_prompt=False,
                template_kwargs=template_kwargs,
                chat_template=chat_template,
                tools=tools,
            )
            return _cut_after_final_message(rendered, messages)
        template = self._template if chat_template is None else self._compiled(chat_template)
        if template is None:
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions (or LLM.generate) with a "
                "prompt string instead"
            )
        kwargs = _checked_template_kwargs(template_kwargs)
        extra = {**kwargs, "tools": list(tools)} if tools else kwargs
        try:
            return template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except InvalidRequestError:
            raise
        except MemoryError:
            raise
        except Exception:
            # Whatever the template raised (TemplateError, TypeError on a kwarg of the wrong
            # type, ...), its text and traceback are the library's: the client gets ours.
            detail = "check the message roles and content parts"
            if tools:
                detail += ", and the tools"
            if kwargs:
                detail += f", and the types of chat_template_kwargs {sorted(kwargs)[:8]}"
            whose = "the model's" if chat_template is None else "the request's"
            raise InvalidRequestError(
                f"chat template failed: {whose} chat template could not render this "
                f"request; {detail}",
                param="chat_template"
                if chat_template is not None
                else ("chat_template_kwargs" if kwargs else "messages"),
            ) from None


def _tojson(
    value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _cut_after_final_message(rendered: str, messages: Sequence[dict[str, Any]]) -> str:
    """`rendered` up to the end of the last message's text (its last text part)."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        content = texts[-1] if texts else None
    final = content.strip() if isinstance(content, str) else ""
    end = rendered.rfind(final) if final else -1
    if end < 0:
        raise InvalidRequestError(
            "continue_final_message needs a last message with text that the chat template "
            "renders; send a final (assistant) message with text content",
            param="continue_final_message",
        )
    return rendered[: end + len(final)]


def _checked_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The kwargs as template variables: string keys, none reserved, values plain JSON data."""
    if not kwargs:
        return {}
    if not isinstance(kwargs, Mapping):
        raise InvalidRequestError(
            "chat_template_kwargs must be an object of template variables",
            param="chat_template_kwargs",
        )
    for key, value in kwargs.items():
        if not isinstance(key, str):
            raise InvalidRequestError(
                f"chat_template_kwargs keys must be strings, got {type(key).__name__}",
                param="chat_template_kwargs",
            )
        param = f"chat_template_kwargs.{key[:64]}"
        if key in RESERVED_TEMPLATE_ARGS:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {key!r}: the server passes it to the chat "
                f"template itself; remove it from chat_template_kwargs",
                param=param,
            )
        if not _is_json_data(value, _MAX_KWARG_DEPTH):
            raise InvalidRequestError(
                f"chat_template_kwargs[{key[:64]!r}] must be JSON data (null, a boolean, "
                "number, string, list or object)",
                param=param,
            )
    return dict(kwargs)


def _is_json_data(value: Any, depth: int) -> bool:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if depth == 0:
        return False
    if isinstance(value, list | tuple):
        return all(_is_json_data(v, depth - 1) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _is_json_data(v, depth - 1) for k, v in value.items())
    return False
