"""Samples of the executor <-> tensor-parallel worker messages (wire/executor.py)."""

from __future__ import annotations

import numpy as np

from mmserve.errors import FailureKind, RequestFailure
from mmserve.sampling_params import SamplingParams
from mmserve.scheduling.outputs import (
    CachedRequestData,
    GrammarOutput,
    ModelRunnerOutput,
    NewRequestData,
    RunnerPayload,
    SchedulerOutput,
)
from mmserve.wire import Message
from mmserve.wire.executor import (
    WorkerAddItems,
    WorkerFailed,
    WorkerFreeItems,
    WorkerReady,
    WorkerShutdown,
    WorkerStep,
    WorkerStepDone,
)


def scheduler_output(features, num_prompt: int) -> SchedulerOutput:
    payload = RunnerPayload(
        SamplingParams(temperature=0.5, seed=3, logprobs=2),
        np.arange(3 * num_prompt, dtype=np.int64).reshape(3, num_prompt),
        -4,
        (151645,),
    )
    return SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData("r0", list(range(num_prompt)), features, [0, 1, 2], 16, payload)
        ],
        scheduled_cached_reqs=[CachedRequestData("r1", [7], 40)],
        num_scheduled_tokens={"r0": num_prompt - 16, "r1": 1},
        total_num_scheduled_tokens=num_prompt - 15,
        scheduled_encoder_inputs={"r0": list(range(len(features)))},
        free_encoder_identifiers=["gone"],
        finished_req_ids=frozenset({"r2", "r3"}),
        preempted_req_ids=frozenset({"r4"}),
        remote_encoder_inputs={"r5": features[:1]},
    )


def executor_messages(request, remote_request, logprobs) -> list[tuple[str, Message]]:
    """`request`: an EngineCoreRequest with pixels, `remote_request` one with remote items;
    `logprobs(n, k)`: a Logprobs sample."""
    features = request.mm_features
    so = scheduler_output(features, len(request.prompt_token_ids))
    bitmask = np.array([[-1, 0, 5]], dtype=np.int32)
    empty = SchedulerOutput([], [], {}, 0, {}, [], frozenset(), frozenset())
    answer = ModelRunnerOutput(
        {"r0": [5, 6]},
        errors={"r1": RequestFailure("2 embeddings for 3 placeholders", FailureKind.REQUEST)},
        logprobs={"r0": logprobs(2, 3)},
        encoder_arrived=["a"],
        encoder_failed={"b": RequestFailure("encoder gone", FailureKind.INTERNAL)},
        prompt_logprobs={"r0": logprobs(4, 1)},
    )
    return [
        ("worker_add_items", WorkerAddItems("r0", request.encoder_inputs, {})),
        ("worker_add_remote", WorkerAddItems("r1", {}, remote_request.remote_items)),
        ("worker_add_none", WorkerAddItems("r0", {}, {})),
        ("worker_free", WorkerFreeItems(["r0", "r1"])),
        ("worker_step", WorkerStep(7, so, GrammarOutput(("r0",), bitmask))),
        ("worker_step_empty", WorkerStep(0, empty, None)),
        ("worker_shutdown", WorkerShutdown()),
        ("worker_ready", WorkerReady(1, 512, 4096, "torch", "torch", False, (1, 2, 4))),
        (
            "worker_done_rank0",
            WorkerStepDone(
                0, 7, answer, {"encoder_items_encoded": 3}, {"encoder_items_encoded": {"image": 3}}
            ),
        ),
        ("worker_done_rank1", WorkerStepDone(1, 7)),
        ("worker_failed", WorkerFailed(1, "its process exited with code -9")),
    ]
