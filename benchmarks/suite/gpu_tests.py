"""Every test marked gpu as one section: pytest in a subprocess, its JUnit counts recorded.

tests/models/test_gpu.py and any other file with a `pytest.mark.gpu` test (kernels, masks) are
passed by name with `-m gpu`: collecting the whole tree would import test-only dependencies
(openai, jsonschema) that the bare GPU machine does not have.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def gpu_test_files() -> list[str]:
    return sorted(
        path.relative_to(REPO).as_posix()
        for path in (REPO / "tests").rglob("test_*.py")
        if "mark.gpu" in path.read_text(encoding="utf-8")
    )


def run_gpu_tests(timeout_s: float) -> dict[str, Any]:
    files = gpu_test_files()
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
             f"--junitxml={junit}", *files],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        result: dict[str, Any] = {
            "files": files,
            "returncode": proc.returncode,
            "tail": proc.stdout[-1500:],
        }
        if not junit.is_file():
            result["error"] = "pytest wrote no JUnit report: " + proc.stderr[-800:]
            return result
        result.update(_counts(ET.parse(junit).getroot()))
    return result


def _counts(root: ET.Element) -> dict[str, Any]:
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None, "a JUnit report always has a testsuite"
    failed, skipped = [], []
    for case in suite.iter("testcase"):
        name = case.get("name", "?")
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                failed.append(
                    {"test": name, "kind": kind, "message": (node.get("message") or "")[:300]}
                )
        node = case.find("skipped")
        if node is not None:
            skipped.append({"test": name, "reason": (node.get("message") or "")[:200]})
    total = int(suite.get("tests", 0))
    return {
        "tests": total,
        "passed": total - len(failed) - len(skipped),
        "failed": len(failed),
        "skipped": len(skipped),
        "failures": failed,
        "skip_reasons": sorted({s["reason"] for s in skipped}),
        "seconds": float(suite.get("time", 0.0)),
    }
