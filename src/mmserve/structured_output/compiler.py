"""Compile a request's structured-output spec into an llguidance grammar, and check it.

`check_structured_output` runs in the API process before a request is queued (no tokenizer
needed); `GrammarCompiler` runs in the engine core and hands out one fresh matcher per request
from a bounded cache of compiled grammars.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import llguidance
import tokenizers

from mmserve.errors import InvalidRequestError
from mmserve.structured_output.params import PARAM, StructuredOutputParams
from mmserve.structured_output.vocabulary import ll_tokenizer

# Compact JSON (no free whitespace between tokens): a model cannot pad its answer with
# whitespace until max_tokens, and the output is what json.loads reads. A schema may still ask
# for whitespace itself through llguidance's "x-guidance" options.
_JSON_DEFAULTS: llguidance.JsonCompileOptions = {"whitespace_flexible": False}
_WHAT = {
    "json_schema": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
_MAX_MESSAGE_CHARS = 500
DEFAULT_MAX_CACHED_GRAMMARS = 128


def grammar_text(params: StructuredOutputParams) -> str:
    """The llguidance grammar for `params` (not yet checked); raises ValueError on a spec the
    converters refuse outright."""
    kind, spec = params.kind, params.spec
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_DEFAULTS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            '{"type": "object"}', defaults=_JSON_DEFAULTS
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        # a Lark alternation of JSON-quoted literals (Lark strings share JSON's escapes)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in json.loads(spec))
        )
    # Lark, or llama.cpp's GBNF / vLLM's EBNF (`root ::= ...`), which llguidance converts
    return llguidance.grammar_from("grammar", spec)


def compile_grammar(
    params: StructuredOutputParams,
    tokenizer: llguidance.LLTokenizer | None = None,
    *,
    param: str = PARAM,
) -> str:
    """The checked llguidance grammar; InvalidRequestError naming `param` with the
    compiler's message if the spec does not compile."""
    try:
        grammar = grammar_text(params)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    except ValueError as exc:
        is_error, messages = True, [str(exc)]
    if is_error:
        raise InvalidRequestError(
            f"invalid {_WHAT[params.kind]} in {param}: {_short(messages[0])}", param=param
        )
    return grammar


def check_structured_output(params: StructuredOutputParams, *, param: str = PARAM) -> None:
    """Refuse a spec that does not compile, before the request is queued."""
    compile_grammar(params, param=param)


class GrammarCompiler:
    """Compiled grammars by (kind, spec), least recently used dropped beyond `max_cached`;
    each request gets its own copy of the compiled matcher. One thread uses it."""

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        *,
        max_cached: int = DEFAULT_MAX_CACHED_GRAMMARS,
    ) -> None:
        if max_cached < 1:
            raise ValueError(f"max_cached must be at least 1, got {max_cached}")
        self.tokenizer = tokenizer
        self.max_cached = max_cached
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    @classmethod
    def from_tokenizer_file(
        cls, path: Path, *, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> GrammarCompiler:
        """A compiler over the checkpoint's tokenizer.json; masks are `vocab_size` (the
        model's logits width) bits wide, so a padded vocabulary's ids are never allowed."""
        text = path.read_text(encoding="utf-8")
        num_tokens = tokenizers.Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
        n_vocab = max(vocab_size, num_tokens)
        return cls(ll_tokenizer(text, n_vocab=n_vocab, eos_token_ids=eos_token_ids))

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def make_matcher(self, params: StructuredOutputParams) -> llguidance.LLMatcher:
        """A matcher at the start of the grammar; InvalidRequestError if it does not compile."""
        key = (params.kind, params.spec)
        template = self._cache.get(key)
        if template is None:
            grammar = compile_grammar(params, self.tokenizer)
            template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():
                raise InvalidRequestError(
                    f"invalid {_WHAT[params.kind]} in {PARAM}: {_short(template.get_error())}",
                    param=PARAM,
                )
            self._cache[key] = template
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return template.deep_copy()


def _short(message: str) -> str:
    message = message.strip()
    if len(message) <= _MAX_MESSAGE_CHARS:
        return message
    return message[: _MAX_MESSAGE_CHARS - 3] + "..."
