"""A command line copied from vLLM's docs starts mmserve unchanged; vLLM-only flags are said.

The flags a vLLM user brings either work (positional model, --max-model-len,
--limit-mm-per-prompt in both spellings, --served-model-name, --gpu-memory-utilization,
--enforce-eager, --trust-remote-code, -tp 1) or stop start-up with a message that says why.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mmserve.config.model import bundled_toy_model_dir
from tests.support.config_args import args_of
from tests.support.harness import Server, wait_until_idle
from tests.support.hub_cache import COMMIT, make_hub_cache

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def test_vllm_flags_reach_their_fields() -> None:
    args = args_of(
        "--gpu-memory-utilization", "0.85", "-tp", "1", "--pipeline-parallel-size", "1",
        "--trust-remote-code", "--enforce-eager", "--revision", "main", "--tokenizer", "tok",
        "--tokenizer-revision", "v1", "--download-dir", "/models",
        "--limit-mm-per-prompt", "image=2,video=0",
    )  # fmt: skip
    assert args.gpu_memory_utilization == 0.85
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (1, 1)
    assert args.trust_remote_code and args.enforce_eager
    assert (args.revision, args.tokenizer, args.tokenizer_revision) == ("main", "tok", "v1")
    assert args.download_dir == "/models"
    assert args.limit_mm_per_prompt == {"image": 2, "video": 0}
    defaults = args_of()
    assert defaults.gpu_memory_utilization == 0.9 and not defaults.enforce_eager


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--distributed-executor-backend", "ray"], "mmserve has no Ray executor"),
        (["-pp", "4"], "--pipeline-parallel-size 4"),
        (["-tp", "0"], "--tensor-parallel-size must be a positive integer"),
        (["--gpu-memory-utilization", "1.5"], r"in \(0, 1\]; got 1.5"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
        (["--tokenizer-revision", "v1"], "--tokenizer-revision needs --tokenizer"),
        (["--revision", " "], "--revision must not be empty"),
    ],
)
def test_unbuilt_or_nonsense_vllm_flags_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        args_of(*argv)


def test_bad_limit_spelling_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        args_of("--limit-mm-per-prompt", "image:2")
    assert "or image=4,video=1; got 'image:2'" in capsys.readouterr().err


def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mmserve", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_start_up_refusals_exit_2_with_the_reason(tmp_path: Path) -> None:
    proc = run_cli(bundled_toy_model_dir(), "--pipeline-parallel-size", "2")
    assert proc.returncode == 2 and "does not run pipeline stages" in proc.stderr
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    proc = run_cli(bundled_toy_model_dir(), "--generation-config", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "no generation_config.json there" in proc.stderr
    proc = run_cli("acme/not-cached", env=env)
    assert proc.returncode == 2
    assert "acme/not-cached: no such directory, and not found in the local hub cache" in (
        proc.stderr
    )


def ask_about_red_circle(
    server: Server, model: str, *, temperature: float | None = 0, max_tokens: int | None = 8
) -> Any:
    """The reply's text with the defaults given; the whole reply when a field is left out."""
    fields = {"temperature": temperature, "max_tokens": max_tokens}
    png = base64.b64encode((EXAMPLES / "red_circle.png").read_bytes()).decode()
    reply = server.client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                    {"type": "text", "text": "What is in the image?"},
                ],
            }
        ],
        **{name: value for name, value in fields.items() if value is not None},
    )
    assert reply.model == model
    if None in fields.values():
        return reply
    return reply.choices[0].message.content or ""


def test_a_vllm_docs_command_line_serves_a_local_checkpoint(tmp_path: Path) -> None:
    # `vllm serve Qwen/Qwen2-VL-7B-Instruct --max-model-len 4096 --gpu-memory-utilization 0.9
    #  --limit-mm-per-prompt '{"image": 2}' --served-model-name qwen2-vl --trust-remote-code`,
    # with the bundled checkpoint copied to a directory of the user's.
    model_dir = Path(shutil.copytree(bundled_toy_model_dir(), tmp_path / "Qwen2-VL-toy"))
    # a checkpoint's recommended sampling values, as Qwen's carry them (greedy, short here)
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    config.update(temperature=0.0, top_k=1, max_new_tokens=2, repetition_penalty=1.0)
    config_path.write_text(json.dumps(config))
    server = Server(
        model_dir,
        tmp_path / "server.log",
        "--max-model-len", "1024", "--gpu-memory-utilization", "0.9",
        "--limit-mm-per-prompt", '{"image": 2}', "--served-model-name", "qwen2-vl",
        "--trust-remote-code", "--enforce-eager", "--tensor-parallel-size", "1",
        positional=True,
    )  # fmt: skip
    try:
        assert [m.id for m in server.client.models.list().data] == ["qwen2-vl"]
        assert ask_about_red_circle(server, "qwen2-vl") == "a red circle"  # its own fields win
        # fields left out take the generation config's values (vLLM's --generation-config auto)
        for _ in range(2):
            reply = ask_about_red_circle(server, "qwen2-vl", temperature=None, max_tokens=None)
            assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 2)
            assert "a red circle".startswith(reply.choices[0].message.content or "")
        wait_until_idle(server.url)
    finally:
        server.stop()
    log = server.log_path.read_text()
    assert "--trust-remote-code: accepted" in log and "never runs code" in log
    assert "--enforce-eager: decode CUDA graphs and encoder CUDA graphs off" in log
    assert "--gpu-memory-utilization applies to CUDA devices only" in log


def test_a_hub_id_is_served_under_its_own_name(tmp_path: Path) -> None:
    make_hub_cache(tmp_path, "acme/toy-vl", {"main": COMMIT})
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    server = Server("acme/toy-vl", tmp_path / "server.log", positional=True, env=env)
    try:
        assert [m.id for m in server.client.models.list().data] == ["acme/toy-vl"]
        assert ask_about_red_circle(server, "acme/toy-vl") == "a red circle"
    finally:
        server.stop()
    assert f"resolved to {tmp_path}" in server.log_path.read_text()
