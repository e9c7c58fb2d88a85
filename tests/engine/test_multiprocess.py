"""The engine core in its own process: same answers, same errors, and a clear death."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import zmq

from mmserve import LLM, SamplingParams
from mmserve.engine.core.process import CoreLoop
from mmserve.errors import EngineDeadError, PromptTooLongError
from mmserve.multimodal import ProcessedPrompt
from mmserve.processing.mrope import decode_positions
from mmserve.updates import RequestStatus
from mmserve.wire import codec
from mmserve.wire.engine_core import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreShutdown,
    EngineDead,
)
from tests.support.factory import random_image

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def _prompts() -> list:
    return [
        "Tell me a story about a fox",
        {"prompt": f"{IMG}What is it?", "multi_modal_data": {"image": random_image(56, 84, 1)}},
        {
            "prompt": f"{IMG} and {IMG} differ how?",
            "multi_modal_data": {"image": [random_image(70, 42, 2), random_image(42, 70, 3)]},
        },
    ]


PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=12, stop=["a"]),
]


@pytest.fixture(scope="module")
def mp_llm(qwen2_vl_dir: Path):
    with LLM(model=str(qwen2_vl_dir), multiprocess=True, max_num_batched_tokens=64) as llm:
        yield llm


def _summary(outs) -> list[tuple]:
    return [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.num_cached_tokens)
        for o in outs
    ]


def test_outputs_equal_in_process_ones_greedy_seeded_and_with_stop_strings(
    qwen2_vl_dir: Path, mp_llm: LLM
) -> None:
    local = LLM(model=str(qwen2_vl_dir), max_num_batched_tokens=64)
    for params in PARAMS:
        expected = _summary(local.generate(_prompts(), params))
        assert _summary(mp_llm.generate(_prompts(), params)) == expected, params


def test_cached_tokens_report_the_prefix_cache_hit(mp_llm: LLM) -> None:
    image = random_image(56, 56)
    prompt = {"prompt": f"{IMG}Again and again", "multi_modal_data": {"image": image}}
    params = SamplingParams(temperature=0, max_tokens=2)
    first = mp_llm.generate(prompt, params)[0]
    second = mp_llm.generate(prompt, params)[0]
    block = mp_llm.config.block_size
    assert first.num_cached_tokens == 0
    num_prompt = len(second.prompt_token_ids)
    # every full block of the prompt but the one holding the last token (it is recomputed)
    assert second.num_cached_tokens == (num_prompt - 1) // block * block > 0


def test_a_request_that_can_never_run_gets_the_in_process_error(
    qwen2_vl_dir: Path, mp_llm: LLM
) -> None:
    local = LLM(model=str(qwen2_vl_dir), max_num_batched_tokens=64)
    num_tokens = mp_llm.config.max_model_len + 1
    too_long = ProcessedPrompt([5] * num_tokens, [], decode_positions(0, num_tokens, 0), 0, None)
    params = SamplingParams(max_tokens=1)
    errors = []
    for engine in (local.engine, mp_llm.engine):
        with pytest.raises(PromptTooLongError, match="max_model_len") as info:
            engine.add_request("too-long", too_long, params)
        errors.append(str(info.value))
    assert errors[0] == errors[1]
    assert not mp_llm.engine.has_unfinished_requests()
    out = mp_llm.generate("still fine", SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.outputs[0].finish_reason == "length"


def test_the_core_loop_drops_malformed_messages_and_serves_on(qwen2_vl_dir: Path) -> None:
    llm = LLM(model=str(qwen2_vl_dir))
    prompt = llm.engine.input_processor.process("Hello")
    ctx = zmq.Context()
    to_core, inbox = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    outbox, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    inbox.bind("inproc://in")
    to_core.connect("inproc://in")
    from_core.bind("inproc://out")
    outbox.connect("inproc://out")
    loop = CoreLoop(llm.engine.core, inbox, outbox, parent_alive=lambda: True)
    exit_code: list[int] = []
    thread = threading.Thread(target=lambda: exit_code.append(loop.run()))
    thread.start()
    try:
        to_core.send_multipart([b"not a wire message"])
        to_core.send_multipart([b"\xb5\x03\x01", b"truncated"])
        to_core.send_multipart(codec.encode(EngineDead("not for the core")))
        msg = EngineCoreRequest.of("r1", prompt, SamplingParams(max_tokens=3), arrival_time_s=0.0)
        to_core.send_multipart(codec.encode(msg))
        finished = None
        deadline = time.monotonic() + 30
        while finished is None and time.monotonic() < deadline:
            if from_core.poll(1000):
                out = codec.decode(from_core.recv_multipart())
                assert isinstance(out, EngineCoreOutputs)
                finished = next((o for o in out.outputs if o.finished), None)
        assert finished is not None and finished.finish_status is RequestStatus.FINISHED_LENGTH
        to_core.send_multipart(codec.encode(EngineCoreShutdown()))
        thread.join(timeout=10)
        assert exit_code == [0]
    finally:
        for sock in (to_core, inbox, outbox, from_core):
            sock.close(linger=0)
        ctx.term()


def test_a_malformed_message_from_the_engine_is_a_clear_death(qwen2_vl_dir: Path) -> None:
    llm = LLM(model=str(qwen2_vl_dir), multiprocess=True)
    try:
        client = llm.engine.core
        ctx = zmq.Context()
        intruder = ctx.socket(zmq.PUSH)
        intruder.connect(f"ipc://{client._socket_dir}/outputs")
        intruder.send_multipart([b"\xb5\x03\x10garbage"])
        intruder.close(linger=1000)
        ctx.term()
        with pytest.raises(EngineDeadError) as info:
            for _ in range(200):
                llm.generate("x", SamplingParams(max_tokens=1))
        assert "a malformed message from the engine process" in info.value.reason
        with pytest.raises(EngineDeadError):
            llm.generate("and now?", SamplingParams(max_tokens=1))
    finally:
        llm.shutdown()
    assert llm.engine.core.proc.poll() is not None


def test_killing_the_engine_process_raises_instead_of_hanging(qwen2_vl_dir: Path) -> None:
    llm = LLM(model=str(qwen2_vl_dir), multiprocess=True)
    proc = llm.engine.core.proc
    killer = threading.Timer(1.0, os.kill, (proc.pid, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    try:
        with pytest.raises(EngineDeadError) as info:
            llm.generate("a very long story", SamplingParams(max_tokens=100000, ignore_eos=True))
        assert "killed by signal 9" in info.value.reason
    finally:
        killer.join()
        llm.shutdown()
    assert time.monotonic() - start < 20
