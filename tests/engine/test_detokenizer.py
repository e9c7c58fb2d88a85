"""Incremental detokenization equals full decoding, and stop strings cut the text."""

from __future__ import annotations

from tokenizers import Tokenizer

from mmserve.engine.frontend.detokenizer import IncrementalDetokenizer
from tests.support.factory import build_tokenizer


def _decode_fn(tok: Tokenizer):
    return lambda ids, skip: tok.decode(list(ids), skip_special_tokens=skip)


def test_incremental_text_equals_full_decode(tmp_path):
    tok = build_tokenizer(tmp_path)
    text = "héllo wörld — a red circle 🙂 in the top left"
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(_decode_fn(tok))
    pieces = [detok.add_tokens([i]) for i in ids]
    assert "".join(pieces) == tok.decode(ids) == detok.text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_truncates_and_reports(tmp_path):
    tok = build_tokenizer(tmp_path)
    ids = tok.encode("a red circle. The end").ids
    detok = IncrementalDetokenizer(_decode_fn(tok), stop=["circle"])
    for i in ids:
        detok.add_tokens([i])
    assert detok.text == "a red "
    assert detok.stop_reason == "circle"
    keep = IncrementalDetokenizer(_decode_fn(tok), stop=["circle"], include_stop_str_in_output=True)
    keep.add_tokens(ids)
    assert keep.text == "a red circle"
