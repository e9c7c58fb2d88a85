"""Make PyPI's torchvision importable beside the CPU build of torch (tests only).

transformers' Qwen2VLVideoProcessor, the oracle the video tests compare against, needs an
importable torchvision. The torchvision wheel on PyPI that pins our torch is a CUDA build: its
compiled ops cannot load beside a `+cpu` torch, and two fake-kernel registrations in
`_meta_registrations.py` are not guarded by `extension._has_ops()` the way the others are, so
`import torchvision` fails. Guarding those two lines is enough: the video transforms the oracle
uses are pure torch. Idempotent; does nothing when torchvision is absent or already importable.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

UNGUARDED = re.compile(r'^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$', re.MULTILINE)
GUARDED = (
    r'@(torch.library.register_fake("torchvision::\1") '
    r"if torchvision.extension._has_ops() else (lambda f: f))"
)


def importable() -> bool:
    probe = "import torchvision, torchvision.transforms.v2.functional"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None or importable():
        return 0
    path = Path(spec.origin).parent / "_meta_registrations.py"
    text = path.read_text()
    patched, count = UNGUARDED.subn(GUARDED, text)
    if count:
        path.write_text(patched)
    if not importable():
        print(f"torchvision still fails to import after patching {path}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
