"""The bench is a client: it must run against any server, so it imports no other mmserve code."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import mmserve.bench

ALLOWED_THIRD_PARTY = {"httpx", "numpy", "PIL", "tqdm", "matplotlib", "prometheus_client"}


def test_bench_imports_only_itself_the_stdlib_and_its_client_libraries() -> None:
    package_dir = Path(mmserve.bench.__file__).parent
    offenders = []
    for path in sorted(package_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                is_ok = (
                    name.startswith("mmserve.bench")
                    or top in ALLOWED_THIRD_PARTY
                    or top in sys.stdlib_module_names
                    or top == "__future__"
                )
                if not is_ok:
                    offenders.append(f"{path.name}: {name}")
    assert offenders == []
