#!/usr/bin/env bash
# On a bare GPU machine (PyTorch, Triton and transformers preinstalled, no internet): install
# mmserve's other dependencies from the vendored wheels in .whl/ (scripts/vendor_wheels.sh),
# never touching torch, triton or transformers, then print the versions the suite will use.
# Idempotent: a second run finds everything satisfied and takes a couple of seconds.
#
#   bash benchmarks/gpu_install.sh            # then: python benchmarks/gpu_suite.py --out ...
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$(command -v python || command -v python3)}"
WHEELS="$REPO/.whl"
cd "$REPO"
export PYTHONPATH="$REPO/src:$REPO${PYTHONPATH:+:$PYTHONPATH}"

if [ ! -f "$WHEELS/requirements.txt" ]; then
    echo "no $WHEELS/requirements.txt: run scripts/vendor_wheels.sh where there is internet" \
         "and carry .whl to this machine" >&2
    exit 1
fi
glibc="$(ldd --version 2>/dev/null | head -1 | grep -oE '[0-9]+\.[0-9]+$' || true)"
echo "$PY: python $("$PY" -c 'import platform; print(platform.python_version())'), glibc ${glibc:-?}"

# Pin what is preinstalled, so that a wheel's requirement can never replace it (pip fails
# instead). A package that is absent is simply not pinned.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$PY" - > "$constraints" <<'PYEOF'
import importlib.metadata as md
for dist in ("torch", "triton", "transformers", "numpy"):
    try:
        print(f"{dist}=={md.version(dist)}")
    except md.PackageNotFoundError:
        pass
PYEOF
# PEP 668 images mark the system Python as externally managed; this machine is ours to change.
PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install --quiet --disable-pip-version-check \
    --no-index --find-links "$WHEELS" -c "$constraints" -r "$WHEELS/requirements.txt"

"$PY" - <<'PYEOF'
import importlib, importlib.metadata as md
import torch
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"available: {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ")"))
for dist in ("triton", "transformers", "numpy", "tokenizers", "safetensors", "pillow", "msgspec",
             "pyzmq", "fastapi", "uvicorn", "pydantic", "llguidance", "blake3", "pytest"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist} MISSING")
# The suite and tests/models/test_gpu.py import these; fail here, not ten minutes in.
for module in ("mmserve.engine.frontend.llm", "mmserve.models.qwen2_vl_vision", "transformers",
               "tests.support.factory", "tests.support.oracle", "pytest"):
    importlib.import_module(module)
print("imports ok")
PYEOF
