"""The wire package is a leaf: importing it pulls in neither torch nor the engine."""

from __future__ import annotations

import subprocess
import sys


def test_importing_wire_does_not_import_torch():
    code = (
        "import sys, mmserve.wire, mmserve.multimodal\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('mmserve.engine')"
        " or m.startswith('mmserve.execution'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
