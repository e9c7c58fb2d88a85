"""The API process does not import torch: its side of the engine (front end, factory, app) runs
with torch blocked, and answers as the in-process engine does."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

from mmserve import LLM, SamplingParams
from tests.support.factory import png_bytes

ROOT = Path(__file__).resolve().parents[2]

# Any `import torch` (or of a torch submodule) in the subprocess fails, as if torch were absent.
BLOCK_TORCH = """
import importlib.abc, sys

class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"{name} is blocked: the API process must not import torch")
        return None

sys.meta_path.insert(0, _NoTorch())
"""

IMAGE_URL = "data:image/png;base64," + base64.b64encode(png_bytes(56, 84, seed=4)).decode()
MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": IMAGE_URL}},
            {"type": "text", "text": "What is in the picture?"},
        ],
    }
]
MAX_TOKENS = 8


def _run(code: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + code],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )


def test_the_api_process_modules_import_with_torch_blocked():
    code = """
import importlib, pkgutil
import mmserve.engine.frontend as frontend

names = ["mmserve.api.app", "mmserve.engine.factory", "mmserve.cli"]
names += [m.name for m in pkgutil.iter_modules(frontend.__path__, "mmserve.engine.frontend.")]
for name in names:
    importlib.import_module(name)
assert "torch" not in sys.modules
print(len(names))
"""
    result = _run(code, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) >= 12  # the app, factory, cli and the front end's modules


def test_a_chat_with_an_image_through_the_engine_process_with_torch_blocked(qwen2_vl_dir):
    """The engine process (its own interpreter) imports torch; the API process never does, and
    its greedy answer is the in-process engine's, token for token."""
    with LLM(model=str(qwen2_vl_dir)) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        (expected,) = llm.chat(MESSAGES, params, use_tqdm=False)
    code = f"""
import asyncio, json
from mmserve.config.engine import EngineConfig
from mmserve.engine.frontend.async_engine import build_async_engine
from mmserve.sampling_params import SamplingParams

async def main():
    engine = build_async_engine(EngineConfig.from_kwargs(model={str(qwen2_vl_dir)!r}))
    try:
        prompt = await engine.process_chat(json.loads({json.dumps(json.dumps(MESSAGES))}))
        params = SamplingParams(temperature=0, max_tokens={MAX_TOKENS}, ignore_eos=True)
        async for out in engine.generate(prompt, params, "r0"):
            last = out
    finally:
        await engine.shutdown()
    return last.outputs[0]

out = asyncio.run(main())
assert "torch" not in sys.modules
print(json.dumps({{"token_ids": list(out.token_ids), "text": out.text}}))
"""
    result = _run(code, timeout=300)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["token_ids"] == list(expected.outputs[0].token_ids)
    assert answer["text"] == expected.outputs[0].text
