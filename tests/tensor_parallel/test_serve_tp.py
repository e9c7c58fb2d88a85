"""`mmserve serve -tp 2`: answers as the one-device engine; a worker killed mid-request ends
every request with an error, /health stops saying 200 and the server exits non-zero."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from mmserve import LLM, SamplingParams
from tests.support.factory import png_bytes
from tests.support.harness import Server, data_url, image_part, user
from tests.tensor_parallel.conftest import SMALL_KV
from tests.tensor_parallel.ranks import is_alive, rank_pids

TP_FLAGS = ("-tp", "2", "--kv-cache-memory-bytes", str(SMALL_KV["kv_cache_memory_bytes"]))
# the acceptance bound of issue #34 for a server to stop after a worker died
EXIT_BOUND_S = 10.0


@pytest.fixture(scope="module")
def server(tp_checkpoints, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("tp_logs") / "server.log"
    srv = Server(tp_checkpoints["qwen2_5_vl"], log, *TP_FLAGS, "--max-num-batched-tokens", "32")
    yield srv
    srv.stop()


def test_chat_with_image_equals_one_device(server: Server, tp_checkpoints) -> None:
    messages = user(image_part(data_url(png_bytes(56, 84, seed=1))), "What is in the image?")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model=str(tp_checkpoints["qwen2_5_vl"]), **SMALL_KV) as llm:
        offline = llm.chat(messages, greedy)[0]
    name = server.client.models.list().data[0].id
    for _ in range(2):  # the second: encoder cache and prefix cache hits on the ranks
        resp = server.client.chat.completions.create(
            model=name,
            messages=messages,
            temperature=0,
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
        assert resp.choices[0].message.content == offline.outputs[0].text
    assert sorted(rank_pids(server.proc.pid)) == [0, 1]


def test_a_killed_worker_fails_every_request_and_stops_the_server(server: Server) -> None:
    """Runs last in the module: it takes the shared server down."""
    name = server.client.models.list().data[0].id
    errors: list[BaseException] = []
    started = threading.Event()

    def in_flight() -> None:
        try:
            stream = server.client.chat.completions.create(
                model=name,
                messages=user("Count."),
                max_tokens=3000,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in stream:
                started.set()
            errors.append(AssertionError("the stream ended without an error"))
        except (openai.APIError, httpx.HTTPError) as exc:
            errors.append(exc)
        finally:
            started.set()

    threads = [threading.Thread(target=in_flight) for _ in range(3)]
    for t in threads:
        t.start()
    assert started.wait(timeout=120)
    pids = rank_pids(server.proc.pid)
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.monotonic()
    returncode = server.proc.wait(timeout=60)
    exit_s = time.monotonic() - killed_at
    for t in threads:
        t.join(timeout=60)
    log = server.log_path.read_text()
    assert returncode != 0, log
    assert len(errors) == 3 and not any(isinstance(e, AssertionError) for e in errors), errors
    assert "tensor-parallel rank 1" in log  # the reason names the rank
    # NOTE: the bound of the issue, checked loosely (a loaded machine): the detection itself
    # is a 100 ms poll of the rank's process.
    assert exit_s < 3 * EXIT_BOUND_S, exit_s
    for rank, pid in pids.items():  # no rank outlives the server
        deadline = time.monotonic() + 30
        while is_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not is_alive(pid), f"rank {rank} (pid {pid}) still runs"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=5)
