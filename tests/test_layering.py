"""The package dependency graph as a contract: no import cycles, dependencies point one way, the
torch-free packages stay torch-free, and no source file outgrows a reader.

Every import in src/mmserve counts: top-level, function-local and under `TYPE_CHECKING`. A lazy
import only hides a cycle from the interpreter, not from the reader who has to hold both
modules in mind at once.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "mmserve"
MAX_LINES = 400

# Value types, configuration and the wire codec: what every stage shares. They import nothing
# but each other (and the import-cycle check keeps that acyclic).
FOUNDATION = frozenset(
    {
        "config",
        "cpu_threads",  # the engine's CPU thread policy: the API process and the engine process
        "errors",
        "generation_config",
        "grid",
        "hashing",
        "host_allocator",  # glibc malloc settings (ctypes): the API process and the CPU worker
        "metrics",
        "multimodal",
        "routing",  # rendezvous hashing bounded by load: encoder pools (and replicas)
        "sampling_params",
        "serve_flags",
        "scheduling.outputs",  # the step and its answer: the executor's wire (wire/executor)
        "structured_output.params",  # a value type carried by SamplingParams
        "updates",  # RequestUpdate, Logprobs, RequestStatus: what a step did to a request
        "wire",
    }
)

# Who may import whom, package by package (DESIGN.md §6): api -> engine -> {processing,
# scheduling, structured_output, execution, disaggregation} -> models -> layers, everything on
# the foundation. The engine is split by process: its front end (the API process's side) never
# reaches the core's packages, not even lazily; the factory wires either. A key is a package or
# a module under mmserve; the most specific key that covers an importer gives its rule. Imports
# inside one key's own package are always allowed.
ENGINE_CORE_DEPENDENCIES = frozenset(
    {
        "disaggregation",
        "execution",
        "layers",
        "models",
        "processing",
        "scheduling",
        "structured_output",
    }
)
ALLOWED: dict[str, frozenset[str]] = {
    **{name: FOUNDATION for name in FOUNDATION},
    "layers": FOUNDATION,
    "models": FOUNDATION | {"layers"},
    "processing": FOUNDATION,
    "scheduling": FOUNDATION,
    "structured_output": FOUNDATION | {"scheduling"},
    "execution": FOUNDATION | {"layers", "models", "scheduling", "structured_output"},
    "disaggregation": FOUNDATION | {"execution", "layers", "models", "processing"},
    # The factory and what both processes read at start-up (shape, model source, encoder URLs).
    "engine": FOUNDATION | ENGINE_CORE_DEPENDENCIES | {"engine.core", "engine.frontend"},
    "engine.core": FOUNDATION
    | ENGINE_CORE_DEPENDENCIES
    | {"engine.remote_encoders", "engine.shape"},
    # Torch-free: admission and the request types, never execution/, models/ or the core.
    "engine.frontend": FOUNDATION
    | {"engine.factory", "engine.shape", "processing", "scheduling", "structured_output"},
    "api": FOUNDATION | {"engine.frontend", "processing", "structured_output"},
    "bench": frozenset(),  # a client of any server: no other mmserve code
    "cli": FOUNDATION | {"api", "bench", "disaggregation", "engine"},
    "__main__": frozenset({"cli"}),
    "": frozenset({"engine", "sampling_params", "structured_output"}),  # mmserve/__init__.py
}

# Packages whose import closure must not reach torch, and what the API process imports: the
# command line, the app (every module of `api/`), the engine's front end and the factory that
# wires it to a core in the engine process.
TORCH_FREE_PACKAGES = ("processing", "scheduling", "wire")
API_PROCESS_MODULES = (
    "mmserve.cli",
    "mmserve.api",
    "mmserve.engine.frontend",
    "mmserve.engine.factory",
)


@dataclass(frozen=True)
class Edge:
    importer: str  # a module, dotted, under mmserve
    imported: str
    line: int
    kind: str  # "top", "local" (inside a function) or "type" (under TYPE_CHECKING)

    def __str__(self) -> str:
        where = _path(self.importer).relative_to(SRC)
        return f"{where}:{self.line} {self.importer} -> {self.imported} ({self.kind})"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _path(module: str) -> Path:
    return MODULES[module]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The mmserve modules an import statement names (a package's __init__ when it names a
    package, or a name defined in one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    base = node.module or ""
    if node.level:
        is_package = MODULES[module].name == "__init__.py"
        anchor = module.split(".")
        anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
        base = ".".join([*anchor, base] if base else anchor)
    if base not in MODULES:
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _edges_of(module: str, source: str) -> list[Edge]:
    edges: list[Edge] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            child_kind = kind
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                child_kind = "local" if kind == "top" else kind
            if isinstance(child, ast.Import | ast.ImportFrom):
                for target in _targets(module, child):
                    if target != module:
                        edges.append(Edge(module, target, child.lineno, kind))
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, "type")
                for stmt in child.orelse:
                    visit_stmt(stmt, kind)
                continue
            visit(child, child_kind)

    def visit_stmt(stmt: ast.stmt, kind: str) -> None:
        wrapper = ast.Module(body=[stmt], type_ignores=[])
        visit(wrapper, kind)

    visit(ast.parse(source), "top")
    return edges


EDGES = sorted({e for m, path in MODULES.items() for e in _edges_of(m, path.read_text())}, key=str)


def _strongly_connected(nodes: list[str], edges: list[Edge]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module."""
    graph: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        graph[e.importer].append(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(graph[node]):
                work.append((node, i + 1))
                nxt = graph[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return components


def _rule_key(module: str) -> str | None:
    """The most specific ALLOWED key covering a module (relative to mmserve)."""
    name = module.removeprefix("mmserve").removeprefix(".")
    if name == "":
        return ""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in ALLOWED:
            return key
    return None


def _covered(module: str, keys: frozenset[str] | set[str]) -> bool:
    name = module.removeprefix("mmserve").removeprefix(".")
    return any(name == k or name.startswith(k + ".") for k in keys if k)


def test_the_scanner_sees_every_kind_of_import() -> None:
    """A guard on the scanner itself: lazy, TYPE_CHECKING and relative imports are found."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "import mmserve.hashing\n"
        "from . import multimodal\n"
        "if TYPE_CHECKING:\n"
        "    from mmserve.sampling_params import SamplingParams\n"
        "def f():\n"
        "    from mmserve import grid\n"
    )
    edges = {(e.imported, e.kind) for e in _edges_of("mmserve.errors", source)}
    assert edges == {
        ("mmserve.hashing", "top"),
        ("mmserve.multimodal", "top"),
        ("mmserve.sampling_params", "type"),
        ("mmserve.grid", "local"),
    }
    assert len(MODULES) > 100 and len(EDGES) > 300
    loop = [Edge("a", "b", 1, "top"), Edge("b", "a", 2, "local"), Edge("b", "c", 3, "type")]
    assert _strongly_connected(["a", "b", "c"], loop) == [["a", "b"]]


def test_no_import_cycles_counting_lazy_and_type_checking_imports() -> None:
    components = _strongly_connected(list(MODULES), EDGES)
    report = []
    for component in components:
        members = set(component)
        inside = [e for e in EDGES if e.importer in members and e.imported in members]
        report.append("cycle: " + " <-> ".join(component))
        report += [f"    {e}" for e in sorted(inside, key=str)]
    assert not components, "\n" + "\n".join(report)


def test_every_package_is_in_the_dependency_table() -> None:
    missing = sorted({m for m in MODULES if _rule_key(m) is None})
    assert not missing, f"add these to ALLOWED in {Path(__file__).name}: {missing}"


def test_dependencies_point_one_way() -> None:
    violations = []
    for e in EDGES:
        key = _rule_key(e.importer)
        if key is None or _rule_key(e.imported) == key:
            continue  # unknown packages are reported above; inside one package is fine
        if not _covered(e.imported, ALLOWED[key]):
            violations.append(str(e))
    assert not violations, "\n" + "\n".join(sorted(violations))


def test_the_dependency_table_has_no_cycle() -> None:
    """The written table itself is a DAG (beyond the foundation, whose modules may import one
    another: the module-cycle test holds them)."""
    table_edges = [
        Edge(k, v, 0, "top")
        for k, allowed in ALLOWED.items()
        if k not in FOUNDATION
        for v in allowed
        if v in ALLOWED and v not in FOUNDATION
    ]
    assert not _strongly_connected(list(ALLOWED), table_edges)


def test_no_source_file_is_over_the_limit() -> None:
    too_long = {
        str(path.relative_to(SRC)): n
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, f"over {MAX_LINES} lines (split by responsibility): {too_long}"


# A subprocess with a finder ahead of every other that refuses torch and records who asked.
_TORCH_BLOCKER = """
import importlib.abc, importlib, pkgutil, sys, traceback
attempts = []
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            chain = [f"{f.filename.split('/src/')[-1]}:{f.lineno}"
                     for f in traceback.extract_stack() if "/src/mmserve/" in f.filename]
            attempts.append(" <- ".join(reversed(chain)) or "(outside mmserve)")
            raise ModuleNotFoundError("torch is blocked in this process", name=name)
        return None
sys.meta_path.insert(0, NoTorch())
errors = []
def load(name):
    try:
        return importlib.import_module(name)
    except Exception as exc:
        errors.append(f"{name}: {type(exc).__name__}: {exc}")
for target in sys.argv[1:]:
    module = load(target)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), target + "."):
        load(info.name)
if attempts or errors or "torch" in sys.modules:
    print("\\n".join(sorted(set(attempts))))
    print("\\n".join(errors))
    sys.exit(1)
"""


def _torch_free(*targets: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _TORCH_BLOCKER, *targets],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=SRC.parent,
    )


@pytest.mark.parametrize("package", TORCH_FREE_PACKAGES)
def test_a_torch_free_package_imports_without_torch(package: str) -> None:
    """Every module of the package imports in a process where torch cannot be imported."""
    result = _torch_free(f"mmserve.{package}")
    assert result.returncode == 0, f"torch reached from:\n{result.stdout}{result.stderr[-2000:]}"


def test_the_api_process_imports_its_app_without_torch() -> None:
    """The API process runs no model: its command line, app and engine client import with
    torch blocked."""
    result = _torch_free(*API_PROCESS_MODULES)
    assert result.returncode == 0, f"torch reached from:\n{result.stdout}{result.stderr[-2000:]}"
