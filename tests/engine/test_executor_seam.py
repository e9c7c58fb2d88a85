"""The Executor protocol admits an executor across a process boundary, scheduler unchanged.

`WireLoopbackExecutor` does what an executor in another process would: every step goes through
the wire codec to a runner that only ever sees the decoded step, and the answer comes back
through the codec. Greedy outputs must equal the in-process executor's, on budgets tight
enough that prompts are chunked, items of running requests are encoded in later steps and
requests are preempted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mmserve import LLM, SamplingParams
from mmserve.execution.executor import Executor, InProcessExecutor
from mmserve.execution.model_runner import ModelRunner
from mmserve.execution.request_state import payload_from_wire
from mmserve.scheduling.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from mmserve.scheduling.scheduler import Scheduler
from mmserve.wire import WireModelRunnerOutput, WireSchedulerOutput, convert, decode, encode
from tests.support.factory import random_image
from tests.support.faults import rewired, run_all

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Tight on purpose: 16 tokens a step chunks every prompt (so the second picture of a request
# is encoded while it is already running) and 24 blocks of 4 preempt some of 6 requests.
TIGHT = {"block_size": 4, "num_gpu_blocks_override": 24, "max_num_batched_tokens": 16}


class WireLoopbackExecutor:
    """The scheduler side encodes each step; the "worker" side decodes it and runs its own
    runner, which never sees an in-process object; the answer travels back the same way."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.worker = runner
        self.scheduler = scheduler  # the sending side's requests: where an item's pixels are
        self.num_steps = 0
        self.num_frames = 0
        self.num_cached_encodes = 0  # items encoded for a request the worker already holds
        self.num_resumed = 0  # new requests the worker had seen before: resumed after preemption
        self._seen_ids: set[str] = set()

    def execute(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        requests = self.scheduler.requests
        msg = convert.scheduler_output_to_wire(
            scheduler_output, lambda rid: requests[rid].mm_features, grammar_output
        )
        frames = [bytes(f) for f in encode(msg)]  # what a socket would carry
        self.num_steps += 1
        self.num_frames += len(frames)
        answer = self._worker_step(frames)
        decoded = decode([bytes(f) for f in answer])
        assert isinstance(decoded, WireModelRunnerOutput)
        return convert.runner_output_from_wire(decoded)

    def _worker_step(self, frames: list[bytes]) -> list:
        msg = decode(frames)
        assert isinstance(msg, WireSchedulerOutput)
        step = convert.scheduler_output_from_wire(msg, payload_from_wire)
        new_ids = {r.request_id for r in step.scheduler_output.scheduled_new_reqs}
        self.num_resumed += len(new_ids & self._seen_ids)
        self._seen_ids |= new_ids
        self.num_cached_encodes += sum(
            len(idxs) for rid, idxs in msg.scheduled_encoder_inputs.items() if rid not in new_ids
        )
        out = self.worker.execute(
            step.scheduler_output, step.grammar_output, encoder_inputs=step.encoder_inputs
        )
        return encode(convert.runner_output_to_wire(out))

    def check_health(self) -> None:
        self.worker.check_device()

    def shutdown(self) -> None:
        self.worker.states.clear()


def _requests(llm: LLM) -> dict[str, object]:
    prompt = (
        "<|im_start|>user\n{}Compare {} with the other one, please.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    processor = llm.engine.input_processor
    items = {
        f"r{i}": {
            "prompt": prompt.format(IMG, IMG),
            "multi_modal_data": {
                "image": [random_image(56, 84, seed=i), random_image(84, 56, seed=i % 2)]
            },
        }
        for i in range(5)
    }
    items["text"] = "<|im_start|>user\nsay something<|im_end|>\n<|im_start|>assistant\n"
    return {rid: processor.process_generate_input(item) for rid, item in items.items()}


def _greedy(llm: LLM, executor: Executor) -> dict[str, list[int]]:
    engine = rewired(llm.engine, executor=executor)
    for rid, prompt in _requests(llm).items():
        engine.add_request(rid, prompt, GREEDY)
    finals = run_all(engine)
    assert all(out.error_kind is None for out in finals.values()), finals
    return {rid: list(out.outputs[0].token_ids) for rid, out in finals.items()}


def test_greedy_outputs_are_the_same_through_the_wire(diverse_checkpoint: Path) -> None:
    in_process = LLM(model=str(diverse_checkpoint), **TIGHT)
    expected = _greedy(in_process, in_process.engine.executor)

    through_wire = LLM(model=str(diverse_checkpoint), **TIGHT)
    default = through_wire.engine.executor
    assert isinstance(default, InProcessExecutor)
    loopback = WireLoopbackExecutor(default.runner, through_wire.engine.scheduler)
    got = _greedy(through_wire, loopback)

    assert got == expected and len(got) == 6
    assert all(len(tokens) == GREEDY.max_tokens for tokens in got.values())
    # the paths that differ from in-process were taken: a running request's item was encoded
    # from the step's pixels, and some request was preempted and resumed
    assert loopback.num_cached_encodes > 0
    assert loopback.num_resumed > 0


def test_the_in_process_executor_refuses_steps_after_shutdown(diverse_checkpoint: Path) -> None:
    llm = LLM(model=str(diverse_checkpoint))
    executor = llm.engine.executor
    executor.check_health()
    executor.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        executor.check_health()
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.execute(llm.engine.scheduler.schedule())
