"""The checkpoint's tokenizer (tokenizers library) and its Jinja chat template (sandboxed)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers
from jinja2 import TemplateError
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

    def encode(self, text: str) -> list[int]:
        """Token ids of text; special-token strings in it become their ids (as in HF)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render messages (already normalised by `processing.chat`) with the chat template."""
        if self._template is None:
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions (or LLM.generate) with a "
                "prompt string instead"
            )
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **template_kwargs,
            )
        except InvalidRequestError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError):
            raise InvalidRequestError(
                "the messages could not be rendered with the model's chat template; check the "
                "message roles and content parts"
            ) from None
