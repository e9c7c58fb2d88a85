"""The checkpoint's vocabulary as llguidance sees it: each token's bytes, and which are special.

llguidance (1.9) reading a tokenizer.json takes every added token for a special one, even those
marked `"special": false` that the model writes as text (Qwen's `<tool_call>`, `<think>`): a
grammar that must write such a tag then allows only that token, and refuses it when sampled.
For byte-level BPE vocabularies (Qwen's) the token table is built here instead, each token with
its own bytes and only the truly special ones marked; anything else goes to llguidance's loader.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance
import tokenizers


def ll_tokenizer(
    tokenizer_json: str, *, n_vocab: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """An LLTokenizer of `n_vocab` ids (the model's logits width) over a tokenizer.json."""
    spec = json.loads(tokenizer_json)
    added = spec.get("added_tokens") or []
    if all(a.get("special", True) for a in added) or not _is_byte_level(spec):
        return llguidance.LLTokenizer(
            tokenizer_json, n_vocab=n_vocab, eos_token=list(eos_token_ids)
        )
    byte_of = {ch: b for b, ch in _byte_level_alphabet().items()}
    table = [b""] * n_vocab
    for text, token_id in spec["model"]["vocab"].items():
        if token_id < n_vocab:
            table[token_id] = bytes(byte_of[ch] for ch in text)
    special = []
    for token in added:
        if token["id"] < n_vocab:
            table[token["id"]] = token["content"].encode("utf-8")
            if token.get("special", True):
                special.append(token["id"])
    vocab = _Vocabulary(tokenizers.Tokenizer.from_str(tokenizer_json), table, special)
    vocab.eos_token_id = eos_token_ids[0] if eos_token_ids else None
    wrapper = llguidance.TokenizerWrapper(vocab)
    return llguidance.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=list(eos_token_ids))


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: token bytes, special ids, and an encoder."""

    bos_token_id = None
    eos_token_id: int | None = None

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, table: list[bytes], special: list[int]
    ) -> None:
        self._tokenizer = tokenizer
        self.tokens = table
        self.special_token_ids = special

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def _is_byte_level(spec: dict[str, Any]) -> bool:
    decoder = spec.get("decoder") or {}
    kinds = [d.get("type") for d in decoder.get("decoders", [])] or [decoder.get("type")]
    return spec.get("model", {}).get("type") == "BPE" and "ByteLevel" in kinds


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: every byte as one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet
