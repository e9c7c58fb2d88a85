#!/usr/bin/env bash
# Download into .whl/ the wheels a bare GPU machine needs to run mmserve from the source tree.
#
# The GPU machine has PyTorch, Triton and transformers preinstalled and no internet; everything
# else mmserve imports travels as wheels in the git-ignored .whl/ folder (the device tool
# carries at most 64 MiB of ignored paths). Its Python version is unknown in advance, so each
# wheel is fetched for 3.11-3.13 (abi3 and pure-python wheels are shared between them); 3.10 is
# left out because mmserve requires Python >= 3.11 (and llguidance >= 1.9 has no 3.10 wheel).
#
# Left out on purpose:
#   torch, triton, transformers  preinstalled there (a second copy would be gigabytes)
#   numpy                        transformers requires it, so it is there (16 MB per Python)
#   matplotlib                   only `mmserve bench` plots import it, never the suite
# pytest and pytest-timeout are added: the suite runs tests/models/test_gpu.py as one section.
# Wheels of packages the GPU image already ships at versions that satisfy pyproject.toml
# (PREINSTALLED) are deleted after the download: they stay in requirements.txt, pip finds them
# installed there, and without them .whl fits the device's 64 MiB carry limit with the tree
# (av alone is 34 MB). Set PREINSTALLED="" to keep every wheel for a machine without them.
#
#   bash scripts/vendor_wheels.sh            # Python 3.11, 3.12 and 3.13
#   PYTHONS="3.12" bash scripts/vendor_wheels.sh
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
DEST="${DEST:-$REPO/.whl}"
PYTHONS="${PYTHONS:-3.11 3.12 3.13}"
EXCLUDE="torch triton transformers numpy matplotlib"
EXTRA="pytest pytest-timeout"
PREINSTALLED="${PREINSTALLED-pillow tokenizers huggingface_hub hf_xet pyyaml pygments pytest pluggy iniconfig}"

requirements() {
    "$PY" - "$REPO/pyproject.toml" "$EXCLUDE" "$EXTRA" <<'PYEOF'
import re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
excluded = set(sys.argv[2].split())
for dep in deps:
    name = re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0].lower()
    if name not in excluded:
        print(dep)
for extra in sys.argv[3].split():
    print(extra)
PYEOF
}

mkdir -p "$DEST"
requirements > "$DEST/requirements.txt"
echo "requirements ($(wc -l < "$DEST/requirements.txt")): $(tr '\n' ' ' < "$DEST/requirements.txt")"
for version in $PYTHONS; do
    echo "== Python $version"
    # llguidance publishes manylinux_2_31 wheels only, so the GPU machine needs glibc >= 2.31
    # (Ubuntu 20.04 or later); gpu_install.sh says so if its glibc is older.
    "$PY" -m pip download --quiet --dest "$DEST" --only-binary=:all: \
        --python-version "$version" --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -r "$DEST/requirements.txt"
done
# numpy is a dependency of nothing listed; if a resolver ever pulls it in, drop it again.
rm -f "$DEST"/numpy-*.whl
for name in $PREINSTALLED; do
    rm -f "$DEST/$name"-*.whl
done
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
