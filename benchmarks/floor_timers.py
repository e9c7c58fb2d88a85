"""Timers around the model work of an in-process engine core, for compute_floor.py.

They attach from outside, without changing the engine: forward hooks on the vision tower and on
the whole model, a wrapper around `compute_logits` and around the runner's `sample_step`, and an
executor that wraps the core's, which sees every step's SchedulerOutput (to tell decode-only
steps from steps with prefill) and the time of the whole `execute`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mmserve.execution import model_runner as model_runner_module

PHASES = ("vit", "lm_prefill", "lm_decode", "logits", "sampling")


@dataclass
class StepRecord:
    num_tokens: int
    num_seqs: int
    is_decode_only: bool  # every scheduled request got exactly one token
    execute_s: float = 0.0
    execute_cpu_s: float = 0.0
    phases_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # CPU seconds of this process in each phase: on a loaded machine the wall time of a phase
    # includes waiting for a core, its CPU time does not (on a GPU it is the host's share)
    phases_cpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))


class StepClock:
    """Seconds of each phase in the current step; on a GPU each reading synchronizes first, so
    a phase owns its kernels (the timers then cost a sync each, as a floor should)."""

    def __init__(self, device: torch.device) -> None:
        self.is_cuda = device.type == "cuda"
        self.steps: list[StepRecord] = []
        self.current: StepRecord | None = None
        self._started: dict[str, tuple[float, float]] = {}
        self.vit_calls = 0
        self.vit_items = 0  # images (or video items) through the vision tower

    def now(self) -> float:
        if self.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self, phase: str) -> None:
        self._started[phase] = (self.now(), time.process_time())

    def stop(self, phase: str) -> None:
        started = self._started.pop(phase, None)
        if started is None or self.current is None:
            return
        wall_s, cpu_s = self.now() - started[0], time.process_time() - started[1]
        if phase == "lm":
            phase = "lm_decode" if self.current.is_decode_only else "lm_prefill"
        self.current.phases_s[phase] += wall_s
        self.current.phases_cpu_s[phase] += cpu_s


class TimedExecutor:
    """The core's executor, with every `execute` timed and recorded as one StepRecord."""

    def __init__(self, inner: Any, clock: StepClock) -> None:
        self.inner = inner
        self.clock = clock

    def execute(self, scheduler_output: Any, grammar_output: Any = None) -> Any:
        counts = scheduler_output.num_scheduled_tokens  # request id -> tokens this step
        record = StepRecord(
            num_tokens=scheduler_output.total_num_scheduled_tokens,
            num_seqs=len(counts),
            is_decode_only=bool(counts) and all(n == 1 for n in counts.values()),
        )
        self.clock.current = record
        started, started_cpu = self.clock.now(), time.process_time()
        try:
            return self.inner.execute(scheduler_output, grammar_output)
        finally:
            record.execute_s = self.clock.now() - started
            record.execute_cpu_s = time.process_time() - started_cpu
            self.clock.steps.append(record)
            self.clock.current = None

    def __getattr__(self, name: str) -> Any:  # add_mm_data, free_mm_data, shutdown, ...
        return getattr(self.inner, name)


def _hook_module(module: nn.Module, clock: StepClock, phase: str) -> list[Any]:
    pre = module.register_forward_pre_hook(lambda *_: clock.start(phase))
    post = module.register_forward_hook(lambda *_: clock.stop(phase))
    return [pre, post]


def _count_vit_items(clock: StepClock, args: tuple[Any, ...]) -> None:
    """The vision tower is called as (pixel_values, grid_thw, ...): one grid per item."""
    clock.vit_calls += 1
    clock.vit_items += len(args[1]) if len(args) > 1 else 1


def _timed(fn: Callable[..., Any], clock: StepClock, phase: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        clock.start(phase)
        try:
            return fn(*args, **kwargs)
        finally:
            clock.stop(phase)

    return wrapper


@contextlib.contextmanager
def timed_core(core: Any, device: torch.device) -> Iterator[StepClock]:
    """Attach the timers to an in-process EngineCore; detach them on exit."""
    clock = StepClock(device)
    runner = core.executor.runner
    model: nn.Module = runner.model
    handles = _hook_module(model.visual, clock, "vit") + _hook_module(model, clock, "lm")
    handles.append(model.visual.register_forward_pre_hook(lambda _m, a: _count_vit_items(clock, a)))
    original_logits = model.compute_logits
    original_sample = model_runner_module.sample_step
    original_executor = core.executor
    model.compute_logits = _timed(original_logits, clock, "logits")
    model_runner_module.sample_step = _timed(original_sample, clock, "sampling")
    core.executor = TimedExecutor(original_executor, clock)
    try:
        yield clock
    finally:
        core.executor = original_executor
        model_runner_module.sample_step = original_sample
        del model.compute_logits  # the instance attribute; the class's method shows again
        for handle in handles:
            handle.remove()
