"""Remote items through the engine core, with a fake EncoderSource running the model's tower.

The same prompts run as local pixels and as remote items (the source encodes the registered
pixels with the model's own vision tower): greedy outputs must match, on budgets that chunk
the prefill through an image. Items held back, failed and cancelled end as a user would see.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.engine.frontend.llm_engine import LLMEngine
from mmserve.errors import FailureKind, RequestFailure
from mmserve.execution.executor import InProcessExecutor
from mmserve.execution.model_runner import ModelRunner
from mmserve.multimodal import EncoderInput, ItemData, ProcessedPrompt, RemoteItem
from mmserve.scheduling.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from tests.support.factory import random_image
from tests.support.fake_encoder_source import FakeEncoderSource
from tests.support.faults import FaultyExecutor, assert_nothing_held, rewired, run_all

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# 16 tokens a step: every prompt's prefill is chunked, some chunks end inside an image.
TIGHT = {
    "block_size": 4,
    "max_num_batched_tokens": 16,
    "mm_processor_kwargs": {"max_pixels": 112 * 112},
}


class CountingExecutor:
    """The in-process executor, counting steps and waits (to see that the core never spins)."""

    def __init__(self, executor: InProcessExecutor) -> None:
        self.executor = executor
        self.num_steps = 0
        self.num_waits = 0
        self.windows: list[tuple[str, int, int]] = []  # (request id, start, end) of each step

    def add_mm_data(self, request_id: str, data: Mapping[str, ItemData]) -> None:
        self.executor.add_mm_data(request_id, data)

    def free_mm_data(self, request_ids: Iterable[str]) -> None:
        self.executor.free_mm_data(request_ids)

    def execute(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        self.num_steps += 1
        so = scheduler_output
        for r in [*so.scheduled_new_reqs, *so.scheduled_cached_reqs]:
            start = r.num_computed_tokens
            self.windows.append(
                (r.request_id, start, start + so.num_scheduled_tokens[r.request_id])
            )
        return self.executor.execute(scheduler_output, grammar_output)

    def wait_for_encoder(self, timeout_s: float) -> None:
        self.num_waits += 1
        self.executor.wait_for_encoder(timeout_s)

    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()


@pytest.fixture(scope="module")
def llm(diverse_checkpoint: Path) -> LLM:
    return LLM(model=str(diverse_checkpoint), **TIGHT)


def _remote_engine(llm: LLM) -> tuple[LLMEngine, FakeEncoderSource, CountingExecutor]:
    """The LLM's engine rewired onto a runner (same model, KV and encoder cache) that sends
    remote items to a fake source running the model's vision tower."""
    local = llm.engine.core.executor
    assert isinstance(local, InProcessExecutor)
    runner = local.runner
    dtype = next(runner.model.parameters()).dtype

    def embed(pixels: EncoderInput) -> torch.Tensor:
        values = torch.from_numpy(pixels.normalized()).to(runner.device, dtype)
        return runner.model.embed_multimodal(values, [pixels.grid_thw])[0]

    source = FakeEncoderSource(embed, delay_polls=1)
    remote_runner = ModelRunner(
        runner.model,
        runner.kv_caches,
        runner.encoder,
        block_size=runner.block_size,
        placeholder_token_ids=runner.placeholder_token_ids,
        device=runner.device,
        attention_backend=runner.attention_backend,
        limits=runner.buffers.limits,
        encoder_source=source,
    )
    executor = CountingExecutor(InProcessExecutor(remote_runner))
    return rewired(llm.engine, executor=executor), source, executor


def _prompt(llm: LLM, seeds: list[int]) -> ProcessedPrompt:
    text = "".join(f"Picture {i}: {IMG}" for i in range(len(seeds))) + " Which is brighter?"
    images = [random_image(112 - 28 * (s % 2), 84 + 28 * (s % 2), seed=s) for s in seeds]
    item = {"prompt": text, "multi_modal_data": {"image": images}}
    return llm.engine.input_processor.process_generate_input(item)


def _text_prompt(llm: LLM) -> ProcessedPrompt:
    return llm.engine.input_processor.process_generate_input("Count to ten:")


def _as_remote(prompt: ProcessedPrompt, source: FakeEncoderSource) -> ProcessedPrompt:
    """Every item as the encoder pool would get it: its own identity, its pixels registered."""
    features = []
    data: dict[str, RemoteItem] = {}
    for f in prompt.mm_features:
        pixels = prompt.mm_data[f.identifier]
        assert isinstance(pixels, EncoderInput)
        identifier = hashlib.blake2b(b"remote-image" + f.identifier.encode()).hexdigest()
        # a stand-in for the image file: the fake source encodes the registered pixels
        payload = hashlib.blake2b(pixels.pixel_values.tobytes()).digest()
        digest = hashlib.blake2b(payload, digest_size=32).hexdigest()
        item = RemoteItem("bytes", payload, None, None, 3136, 112 * 112, f.grid_thw, digest)
        source.register(identifier, pixels)
        features.append(msgspec.structs.replace(f, identifier=identifier, is_remote=True))
        data[identifier] = item
    return dataclasses.replace(prompt, mm_features=features, mm_data=data)


def _greedy(engine: LLMEngine, prompts: dict[str, ProcessedPrompt]) -> dict[str, Any]:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    return run_all(engine)


def _tokens(finals: dict[str, Any]) -> dict[str, list[int]]:
    assert all(out.error_kind is None for out in finals.values()), finals
    return {rid: list(out.outputs[0].token_ids) for rid, out in finals.items()}


def _assert_free(engine: LLMEngine, source: FakeEncoderSource) -> None:
    assert_nothing_held(engine)
    stats = engine.core.scheduler.make_stats()
    assert stats.encoder_cache_used_bytes == 0
    assert stats.encoder_inflight_items == stats.encoder_inflight_bytes == 0
    assert source.num_pending() == 0 or source.answers_after_cancel


def test_greedy_outputs_match_the_local_path(llm: LLM) -> None:
    prompts = {"one": _prompt(llm, [1]), "two": _prompt(llm, [2, 3]), "three": _prompt(llm, [4])}
    expected = _tokens(_greedy(llm.engine, prompts))
    engine, source, executor = _remote_engine(llm)
    remote = {rid: _as_remote(p, source) for rid, p in prompts.items()}
    # one item comes back as pixels (the pool's local fallback): encoded by this runner
    source.fallback = {remote["two"].mm_features[1].identifier}
    got = _tokens(_greedy(engine, remote))
    assert got == expected
    assert len(source.submitted) == 4 and not source.cancelled  # each item sent once
    cut_inside = [
        (rid, end)
        for rid, _, end in executor.windows
        for f in remote[rid].mm_features
        if f.placeholder.offset < end < f.placeholder.end
    ]
    assert cut_inside, "no chunk ended inside an image: the test proves less than it says"
    _assert_free(engine, source)
    engine.core.shutdown()
    assert source.is_shut_down


def test_text_runs_before_a_held_item_and_the_core_waits_without_spinning(llm: LLM) -> None:
    engine, source, executor = _remote_engine(llm)
    prompt = _as_remote(_prompt(llm, [5]), source)
    offset = prompt.mm_features[0].placeholder.offset
    source.held = {prompt.mm_features[0].identifier}
    engine.add_request("img", prompt, GREEDY)
    engine.add_request("text", _text_prompt(llm), GREEDY)
    finals: dict[str, Any] = {}
    while "text" not in finals:  # the text request decodes to the end meanwhile
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.core.scheduler.requests["img"].num_computed_tokens == offset
    steps_before = executor.num_steps
    threading.Timer(0.3, source.release, [list(source.held)]).start()
    deadline = time.monotonic() + 30
    while source.held and time.monotonic() < deadline:
        engine.step()  # what the engine loop does while a request is unfinished
    # ~15 waits of 20 ms in 0.3 s; a spinning core would take thousands of steps
    assert executor.num_steps - steps_before < 60 and executor.num_waits > 0
    finals.update(run_all(engine))
    assert finals["img"].error is None and len(finals["img"].outputs[0].token_ids) == 6
    _assert_free(engine, source)


def test_abort_cancels_the_item_at_the_source_and_its_late_reply_is_dropped(llm: LLM) -> None:
    engine, source, _ = _remote_engine(llm)
    source.answers_after_cancel = True
    prompt = _as_remote(_prompt(llm, [6]), source)
    identifier = prompt.mm_features[0].identifier
    source.held = {identifier}
    engine.add_request("img", prompt, GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort_requests(["img"])
    engine.step()  # tells the runner: it cancels the item
    assert source.cancelled == [identifier]
    source.release([identifier])
    engine.add_request("text", _text_prompt(llm), GREEDY)
    run_all(engine)  # the late reply arrives and is dropped
    runner = engine.core.executor.executor.runner
    assert runner.remote.num_dropped == 1 and identifier not in runner.encoder_cache
    _assert_free(engine, source)


def test_a_failed_item_fails_exactly_its_requests_with_503_kind(llm: LLM) -> None:
    engine, source, _ = _remote_engine(llm)
    bad = _as_remote(_prompt(llm, [7]), source)
    failure = RequestFailure("no encoder could encode image item 0", FailureKind.UNAVAILABLE)
    source.failures = {bad.mm_features[0].identifier: failure}
    prompts = {"bad": bad, "also_bad": bad, "good": _as_remote(_prompt(llm, [8]), source)}
    finals = _greedy(engine, prompts)
    assert {rid: out.error_kind for rid, out in finals.items()} == {
        "bad": FailureKind.UNAVAILABLE,
        "also_bad": FailureKind.UNAVAILABLE,
        "good": None,
    }
    assert finals["bad"].error == failure.message
    assert len(finals["good"].outputs[0].token_ids) == 6
    _assert_free(engine, source)


def test_a_step_that_raises_fails_the_requests_waiting_for_items_in_flight(llm: LLM) -> None:
    engine, source, executor = _remote_engine(llm)
    faulty = FaultyExecutor(executor)
    engine = rewired(engine, executor=faulty)
    held = _as_remote(_prompt(llm, [11]), source)
    source.held = {held.mm_features[0].identifier}
    engine.add_request("held", held, GREEDY)
    engine.add_request("text", _text_prompt(llm), GREEDY)
    engine.step()
    faulty.crash_after(0)  # its arrivals, if any, are lost with it
    finals = {o.request_id: o for o in engine.step() if o.finished}
    assert {rid: o.error_kind for rid, o in finals.items()} == {
        "held": FailureKind.INTERNAL,
        "text": FailureKind.INTERNAL,
    }
    engine.step()  # the runner hears of it: the item is cancelled at the source
    assert source.cancelled == [held.mm_features[0].identifier]
    _assert_free(engine, source)


def test_an_engine_without_a_source_fails_a_remote_item_with_an_internal_error(llm: LLM) -> None:
    source = FakeEncoderSource(lambda pixels: torch.zeros(0))  # only to build the prompt
    engine = llm.engine  # its runner has no encoder source
    engine.add_request("img", _as_remote(_prompt(llm, [15]), source), GREEDY)
    engine.add_request("text", _text_prompt(llm), GREEDY)
    finals = run_all(engine)
    assert finals["img"].error_kind is FailureKind.INTERNAL
    assert "this engine has none" in finals["img"].error
    assert finals["text"].error is None
    assert_nothing_held(engine)
