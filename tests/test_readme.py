"""The README's examples run as written, and it never points outside the repository."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.harness import Server

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DEFAULT_ADDRESS = "127.0.0.1:8000"


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def python_examples() -> list[str]:
    """The bodies of the `.venv/bin/python - <<'PY' ... PY` examples, in order."""
    return re.findall(r"\.venv/bin/python - <<'PY'\n(.*?)\nPY\n", README, flags=re.S)


def test_links_stay_inside_the_repository() -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        assert not target.startswith(("http:", "https:", "/")), target
        resolved = (ROOT / target.split("#")[0]).resolve()
        assert resolved.is_relative_to(ROOT) and resolved.exists(), target
    assert "../" not in README and "shared/" not in README


def test_the_offline_example_answers_as_promised() -> None:
    offline = next(code for code in python_examples() if "LLM()" in code)
    out = subprocess.run(
        [sys.executable, "-c", offline], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "red"


@pytest.fixture(scope="module")
def toy_server(tmp_path_factory: pytest.TempPathFactory):
    server = Server(
        ROOT / "src" / "mmserve" / "models" / "toy", tmp_path_factory.mktemp("readme") / "log"
    )
    yield server
    server.stop()


def test_the_openai_example_answers_as_promised(toy_server: Server) -> None:
    code = next(code for code in python_examples() if "OpenAI(" in code)
    assert DEFAULT_ADDRESS in code
    code = code.replace(DEFAULT_ADDRESS, f"127.0.0.1:{toy_server.port}")
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "top right"


@pytest.mark.skipif(not (shutil.which("curl") and shutil.which("base64")), reason="needs curl")
def test_the_curl_example_answers_as_promised(toy_server: Server) -> None:
    block = next(b for b in bash_blocks() if b.startswith("curl"))
    script = block.replace(DEFAULT_ADDRESS, f"127.0.0.1:{toy_server.port}")
    out = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["choices"][0]["message"]["content"] == "a red circle"
