"""Two "machines" on the loopback: node 0 (`serve --nnodes 2 --node-rank 0`) and a headless
node 1 answer as one device; a node that never comes is named when the rendezvous times out."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from mmserve import LLM, SamplingParams
from tests.support.factory import png_bytes
from tests.support.harness import Server, data_url, free_port, image_part, user
from tests.tensor_parallel.conftest import SMALL_KV

KV = ("--kv-cache-memory-bytes", str(SMALL_KV["kv_cache_memory_bytes"]))


def _master_port() -> int:
    """A port whose next two are free as well (the steps and the answers sockets)."""
    while True:
        port = free_port()
        try:
            for p in (port + 1, port + 2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port


def _node_flags(node_rank: int, port: int) -> list[str]:
    return [
        "-tp", "2", "--nnodes", "2", "--node-rank", str(node_rank),
        "--master-addr", "127.0.0.1", "--master-port", str(port), *KV,
    ]  # fmt: skip


def test_two_nodes_on_the_loopback_answer_as_one_device(tp_checkpoints, tmp_path: Path) -> None:
    model = tp_checkpoints["qwen3_vl"]
    port = _master_port()
    with open(tmp_path / "node1.log", "w") as node1_log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "mmserve", "serve", "--model", str(model), "--headless"]
            + _node_flags(1, port),
            stdout=node1_log,
            stderr=node1_log,
        )
        try:
            node0 = Server(model, tmp_path / "node0.log", *_node_flags(0, port))
            try:
                messages = user(image_part(data_url(png_bytes(64, 96, seed=2))), "And this?")
                name = node0.client.models.list().data[0].id
                resp = node0.client.chat.completions.create(
                    model=name,
                    messages=messages,
                    temperature=0,
                    max_tokens=8,
                    extra_body={"ignore_eos": True},
                )
            finally:
                node0.stop()
            # node 0's shutdown stops node 1's ranks, and node 1 with them
            assert node1.wait(timeout=60) == 0, (tmp_path / "node1.log").read_text()
        finally:
            if node1.poll() is None:
                node1.kill()
    assert node0.proc.returncode == 0
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model=str(model), **SMALL_KV) as llm:
        expected = llm.chat(messages, greedy)[0].outputs[0].text
    assert resp.choices[0].message.content == expected


def test_a_node_that_never_comes_is_named(tp_checkpoints, tmp_path: Path) -> None:
    log = tmp_path / "node0.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "mmserve", "serve", "--model", str(tp_checkpoints["qwen2_vl"])]
            + _node_flags(0, _master_port())
            + ["--distributed-timeout-seconds", "3", "--port", str(free_port())],
            stdout=out,
            stderr=out,
            timeout=300,
        )
    text = log.read_text()
    assert proc.returncode != 0, text
    assert "waiting for rank(s) 1 of 2" in text, text
