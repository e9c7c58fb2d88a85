"""The grammar's vocabulary: every token has the bytes llguidance's own loader gives it, and an
added token the model writes as text (`"special": false`, as Qwen's `<tool_call>`) is text in a
grammar, not a special token."""

from __future__ import annotations

import json

import llguidance
import tokenizers

from mmserve.structured_output.compiler import compile_grammar
from mmserve.structured_output.params import StructuredOutputParams
from mmserve.structured_output.vocabulary import ll_tokenizer
from tests.support.factory import build_tokenizer

TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def _tokenizer_json(tmp_path, tags: list[str]) -> str:
    tok = build_tokenizer(tmp_path)
    tok.add_tokens(tags)
    return tok.to_str()


def test_tokens_keep_their_bytes_and_text_tags_are_not_special(tmp_path):
    text = _tokenizer_json(tmp_path, TAGS)
    ours = ll_tokenizer(text, n_vocab=448, eos_token_ids=[402])
    reference = llguidance.LLTokenizer(text, n_vocab=448, eos_token=[402])
    added = {a["id"]: a for a in json.loads(text)["added_tokens"]}
    for token_id in range(448):
        if token_id not in added:
            assert ours.decode_bytes([token_id]) == reference.decode_bytes([token_id]), token_id
    for token_id, token in added.items():
        assert ours.is_special_token(token_id) is token["special"], token
        assert reference.is_special_token(token_id)  # the loader's reading, which we avoid


def test_a_grammar_can_write_a_text_tag_as_its_token(tmp_path):
    text = _tokenizer_json(tmp_path, TAGS)
    tok = tokenizers.Tokenizer.from_str(text)
    ll = ll_tokenizer(text, n_vocab=448, eos_token_ids=[402])
    answer = 'ok <tool_call>{"a": 1}</tool_call>'
    grammar = compile_grammar(StructuredOutputParams.regex(answer.replace("{", "\\{")), ll)
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    ids = tok.encode(answer).ids
    assert tok.token_to_id("<tool_call>") in ids
    assert all(matcher.consume_token(i) for i in ids), matcher.get_error()
    assert matcher.is_accepting()


def test_vocabularies_with_only_special_added_tokens_use_the_loader(tmp_path):
    text = _tokenizer_json(tmp_path, [])
    ours = ll_tokenizer(text, n_vocab=448, eos_token_ids=[402])
    reference = llguidance.LLTokenizer(text, n_vocab=448, eos_token=[402])
    assert [ours.decode_bytes([i]) for i in range(448)] == [
        reference.decode_bytes([i]) for i in range(448)
    ]
