"""A grammar compiler over the bundled toy tokenizer, and a JSON schema every model can finish."""

from __future__ import annotations

from pathlib import Path

from mmserve.config.model import bundled_toy_model_dir
from mmserve.structured_output.compiler import GrammarCompiler


def toy_compiler(**kwargs) -> GrammarCompiler:
    compiler = GrammarCompiler.from_tokenizer_file(
        Path(bundled_toy_model_dir()) / "tokenizer.json", vocab_size=576, eos_token_ids=(514, 512)
    )
    return GrammarCompiler(compiler.tokenizer, **kwargs)


# Every valid string is short (enums, a boolean, a bounded integer): even a random model must
# finish within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "shape": {"enum": ["circle", "square", "triangle", "star"]},
        "filled": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["shape", "filled", "count"],
    "additionalProperties": False,
}
