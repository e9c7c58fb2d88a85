"""The test checkpoint factory writes a directory that transformers itself loads."""

from __future__ import annotations

import json

from tokenizers import Tokenizer

from tests.support.factory import SPECIAL_TOKENS


def test_tiny_checkpoint_has_every_file(tiny_checkpoint):
    names = {p.name for p in tiny_checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "preprocessor_config.json" in names
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    tok = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    assert tok.token_to_id("<|image_pad|>") == cfg["image_token_id"]
    for t in SPECIAL_TOKENS:
        assert tok.encode(t).ids == [tok.token_to_id(t)]
