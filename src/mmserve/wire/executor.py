"""Messages between the tensor-parallel executor (engine core) and its worker processes.

executor --PUB (every rank gets each once)--> workers
    WorkerAddItems      a new request's item data (pixels, remote items), by identifier
    WorkerFreeItems     finished requests: their item data goes
    WorkerStep          one SchedulerOutput (+ GrammarOutput) to run, numbered
    WorkerShutdown      stop
workers --PUSH--> executor
    WorkerReady         a rank has loaded its shard and allocated its KV cache
    WorkerStepDone      a rank ran step `step_id`; rank 0's carries the step's answer
    WorkerFailed        a rank cannot go on (start-up failed, a step raised, a rank of its
                        node died): the engine stops
"""

from __future__ import annotations

from mmserve.multimodal import EncoderInput, RemoteItem
from mmserve.scheduling.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from mmserve.wire.common import Identifier, NonNegInt, RequestId, WireStruct

# ------------------------------------------------------------------- executor -> workers


class WorkerAddItems(WireStruct):
    """`Executor.add_mm_data` on every rank: each item's data once (pixels as raw frames)."""

    request_id: RequestId
    encoder_inputs: dict[Identifier, EncoderInput]
    remote_items: dict[Identifier, RemoteItem]


class WorkerFreeItems(WireStruct):
    """`Executor.free_mm_data` on every rank."""

    request_ids: list[RequestId]


class WorkerStep(WireStruct):
    """One step for every rank, in order; `step_id` counts from 0 and names the answers."""

    step_id: NonNegInt
    scheduler_output: SchedulerOutput
    grammar_output: GrammarOutput | None


class WorkerShutdown(WireStruct):
    """Release the device and exit 0."""


# ------------------------------------------------------------------- workers -> executor


class WorkerReady(WireStruct):
    """What a rank's start-up made (`execution.worker.StartedWorker`, less the runner)."""

    rank: NonNegInt
    num_blocks: NonNegInt
    bytes_per_block: NonNegInt
    attention_backend: str
    layer_ops: str
    encoder_cuda_graph: bool
    cuda_graph_sizes: tuple[NonNegInt, ...]
    # -O1..-O3: the start-up compile (`execution.compile.CompileReport`); None when eager
    compile_seconds: float | None = None
    compile_num_graphs: NonNegInt = 0
    compile_cache_dir: str = ""


class WorkerStepDone(WireStruct):
    """Rank `rank` finished step `step_id`. Rank 0's carries the step's answer and its
    encoder counters (what the engine's metrics mirror); the others' only say they are done,
    so a rank that hangs is seen as one."""

    rank: NonNegInt
    step_id: NonNegInt
    output: ModelRunnerOutput | None = None
    counters: dict[str, NonNegInt] = {}
    modality_counters: dict[str, dict[str, NonNegInt]] = {}


class WorkerFailed(WireStruct):
    """Rank `rank` cannot go on; `reason` says why (for the log and every request's error)."""

    rank: NonNegInt
    reason: str
