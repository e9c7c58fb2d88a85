"""The pool is wired in by the factory: nothing below the engine imports `disaggregation/`."""

from __future__ import annotations

import ast
from pathlib import Path

import mmserve

PACKAGE = Path(mmserve.__file__).parent
BELOW_THE_ENGINE = ("execution", "processing", "scheduling", "wire", "models", "layers")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_layer_below_the_engine_imports_the_pool() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for layer in BELOW_THE_ENGINE
        for path in sorted((PACKAGE / layer).rglob("*.py"))
        for name in _imports(path)
        if name == "mmserve.disaggregation" or name.startswith("mmserve.disaggregation.")
    ]
    assert not offenders, offenders
    assert (PACKAGE / "execution" / "encoder" / "source.py").exists()  # the seam it plugs into
