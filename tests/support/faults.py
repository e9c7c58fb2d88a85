"""Small real parts that fail on purpose, and helpers to run an engine and check what it holds."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from mmserve.engine.core.engine_core import EngineCore
from mmserve.engine.frontend.llm_engine import LLMEngine
from mmserve.engine.frontend.outputs import RequestOutput
from mmserve.execution.executor import Executor
from mmserve.multimodal import ItemData
from mmserve.sampling_params import SamplingParams
from mmserve.scheduling.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput


class FaultyExecutor:
    """A real executor that raises at the end of a chosen step, after it really ran (so its
    state has moved on, as when a late part of a step fails), and whose device can "die"."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.steps_until_crash: int | None = None
        self.is_device_dead = False
        self.num_crashes = 0

    def crash_after(self, num_steps: int = 0) -> None:
        """Let `num_steps` steps pass, then raise in the next one (once)."""
        self.steps_until_crash = num_steps

    def add_mm_data(self, request_id: str, data: Mapping[str, ItemData]) -> None:
        self.executor.add_mm_data(request_id, data)

    def free_mm_data(self, request_ids: Iterable[str]) -> None:
        self.executor.free_mm_data(request_ids)

    def execute(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        out = self.executor.execute(scheduler_output, grammar_output)
        if self.steps_until_crash is not None:
            if self.steps_until_crash == 0:
                self.steps_until_crash = None
                self.num_crashes += 1
                raise RuntimeError("injected step failure")
            self.steps_until_crash -= 1
        return out

    def wait_for_encoder(self, timeout_s: float) -> None:
        self.executor.wait_for_encoder(timeout_s)

    def check_health(self) -> None:
        if self.is_device_dead:
            raise RuntimeError("injected: the device is gone")
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()


def rewired(engine: LLMEngine, **parts: Any) -> LLMEngine:
    """A new engine over the same processor, scheduler, executor and outputs, with `parts`
    (constructor arguments) replaced."""
    core = engine.core
    core_parts: dict[str, Any] = {
        "scheduler": core.scheduler,
        "executor": core.executor,
        "metrics": core.metrics,
        "eos_token_ids": core.eos_token_ids,
    }
    core_parts.update({k: v for k, v in parts.items() if k in core_parts})
    kwargs: dict[str, Any] = {
        "input_processor": engine.input_processor,
        "core": EngineCore(**core_parts),
        "output_processor": engine.output_processor,
        "metrics": engine.metrics,
        "max_model_len": engine.max_model_len,
        "max_logprobs": engine.max_logprobs,
        "sampling_defaults": engine.sampling_defaults,
    }
    kwargs.update({k: v for k, v in parts.items() if k not in core_parts})
    return LLMEngine(**kwargs)


def run_all(engine: LLMEngine, max_steps: int = 500) -> dict[str, RequestOutput]:
    """Step until nothing is left; the final output of every request that finished."""
    finals: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError(f"the engine did not finish within {max_steps} steps")


def assert_nothing_held(engine: LLMEngine) -> None:
    """Every KV block and encoder slot is free and no request is tracked anywhere."""
    engine.core.scheduler.check_integrity()
    stats = engine.core.scheduler.make_stats()
    assert stats.num_free_kv_blocks == engine.core.scheduler.cache_config.num_blocks
    assert stats.encoder_cache_used_slots == 0
    assert not engine.has_unfinished_requests()
    assert not engine.output_processor.request_ids
    runner = getattr(getattr(engine.core, "executor", None), "runner", None)
    if runner is not None:  # the in-process executor: no item data left behind
        assert runner.item_data.num_pending == 0 and len(runner.item_data) == 0


def bypassing_validation(params: SamplingParams, **fields: Any) -> SamplingParams:
    """A copy of `params` with `fields` set as given, past `__post_init__`'s checks: what a
    value the edge failed to refuse looks like once it reaches the engine."""
    copy = msgspec.structs.replace(params)
    for name, value in fields.items():
        msgspec.structs.force_setattr(copy, name, value)
    return copy
