"""Tensor-parallel runner tests by record and replay.

A single-device `LLM` runs the requests while `RecordingExecutor` keeps every call the engine
core makes on its executor (item data, each step's SchedulerOutput, frees) and each answer.
`replay_on_rank` then runs on every rank of a gloo group (`run_ranks`): it builds the same
engine (for its settings), loads the rank's shard of the model (the vision tower sharded in
weights mode) and the rank's KV cache with as many blocks, puts a `ModelRunner` with the
rank's `TPGroup` over them, replays the calls and returns, per step, the runner's answer, its
request states and its encoder cache's bytes.
If TP gives the same answers as one device, the recorded SchedulerOutputs are exactly the
ones a TP engine would have scheduled, so the replay is the TP engine's run.

`fail_grids` injects an encoder failure: a vision-tower call holding an item of one of these
grids raises (on the ranks in `fail_ranks`; every rank when None), before the tower runs or,
with `fail_after_compute`, after it (a sharded tower's collectives then still match).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mmserve import LLM
from mmserve.execution.encoder.pixels import ItemDataStore
from mmserve.execution.encoder.runner import EncoderRunner
from mmserve.execution.model_runner import ModelRunner
from mmserve.layers.parallel import TPGroup
from mmserve.models.kv_cache import allocate_kv_caches
from mmserve.models.loader import load_model
from mmserve.scheduling.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput

MAX_PATCHES_PER_CALL = 1 << 20  # the same encoder calls on one device and on the ranks


class RecordingExecutor:
    """Wraps the engine core's executor and records the calls that change the runner."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple] = []
        self.outputs: list[ModelRunnerOutput] = []

    def add_mm_data(self, request_id: str, data: Mapping[str, Any]) -> None:
        self.calls.append(("add", request_id, copy.deepcopy(dict(data))))
        self.inner.add_mm_data(request_id, data)

    def free_mm_data(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        self.calls.append(("free", ids))
        self.inner.free_mm_data(ids)

    def execute(
        self, so: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        # a deep copy now: the scheduler's lists go on changing after the step
        self.calls.append(("execute", copy.deepcopy(so), copy.deepcopy(grammar_output)))
        output = self.inner.execute(so, grammar_output)
        self.outputs.append(copy.deepcopy(output))
        return output

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class CountingEmbed:
    """`embed` that counts the items it encodes and raises for a call holding an item of one
    of `fail_grids` (before the tower runs, or after it with `after`)."""

    def __init__(
        self, embed: Any, fail_grids: Iterable[tuple[int, int, int]] = (), after: bool = False
    ) -> None:
        self.embed = embed
        self.bad = {tuple(g) for g in fail_grids}
        self.after = after
        self.num_items = 0

    def __call__(self, pixels: Any, grids: list[tuple[int, int, int]]) -> Any:
        fails = bool(self.bad & {tuple(g) for g in grids})
        if fails and not self.after:
            raise RuntimeError("injected encoder failure")
        out = self.embed(pixels, grids)
        if fails:
            raise RuntimeError("injected encoder failure after the tower ran")
        self.num_items += len(grids)
        return out


def record(
    model_dir: Path,
    engine_args: dict,
    requests: list[tuple[Any, Any]],
    fail_grids: Iterable[tuple[int, int, int]] = (),
) -> tuple[RecordingExecutor, list, int]:
    """Run `requests` ((prompt, SamplingParams) pairs, all at once) on one device; the
    recording, the results and the number of items the vision tower encoded."""
    llm = LLM(model=str(model_dir), **engine_args)
    core = llm.engine.core
    runner = core.executor.runner
    embed = CountingEmbed(runner.model.embed_multimodal, fail_grids)
    runner.encoder = _encoder(runner, embed)
    recorder = RecordingExecutor(core.executor)
    core.executor = recorder
    with llm:
        results = llm.generate([p for p, _ in requests], [s for _, s in requests])
    return recorder, results, embed.num_items


def replay_on_rank(
    group: TPGroup,
    model_dir: Path,
    engine_args: dict,
    calls: list[tuple],
    mode: str,
    fail_grids: Iterable[tuple[int, int, int]] = (),
    fail_ranks: Iterable[int] | None = None,
    fail_after_compute: bool = False,
) -> tuple[list[dict], int, int]:
    """Replay `calls` on a runner of this rank; per step: the answer in plain data, the
    states' token ids and the encoder cache as {identifier: sha256 of its bytes}; and the
    number of items this rank's vision tower encoded; and the parameters its shard holds."""
    llm = LLM(model=str(model_dir), **engine_args)
    base = llm.engine.core.executor.runner
    fails = fail_ranks is None or group.rank in set(fail_ranks)
    model, model_config = load_model(
        model_dir, base.device, base.encoder_cache.dtype, tp=group, shard_vision=mode == "weights"
    )
    num_blocks = base.kv_caches[0].shape[1]  # [2, num_blocks, block_size, kv_heads, head_dim]
    kv_caches = allocate_kv_caches(
        model_config, num_blocks, base.block_size, base.device, base.encoder_cache.dtype, group
    )
    embed = CountingEmbed(model.embed_multimodal, fail_grids if fails else (), fail_after_compute)
    runner = ModelRunner(
        model,
        kv_caches,
        _encoder(base, embed),
        block_size=base.block_size,
        placeholder_token_ids=base.placeholder_token_ids,
        device=base.device,
        attention_backend=base.attention_backend,
        limits=base.buffers.limits,
        item_data=ItemDataStore(base.item_data.capacity_bytes),
        tp=group,
        mm_encoder_tp_mode=mode,
    )
    steps = []
    identifiers: set[str] = set()
    for call in calls:
        if call[0] == "add":
            runner.add_mm_data(call[1], call[2])
        elif call[0] == "free":
            runner.free_mm_data(call[1])
        else:
            for new in call[1].scheduled_new_reqs:
                identifiers.update(f.identifier for f in new.mm_features)
            output = runner.execute(call[1], call[2])
            steps.append(step_record(runner, output, identifiers))
    llm.shutdown()
    return steps, embed.num_items, sum(p.numel() for p in model.parameters())


def step_record(runner: ModelRunner, output: ModelRunnerOutput, identifiers: set[str]) -> dict:
    """A step's answer, states and encoder cache (the items of `identifiers` it holds) as
    plain, comparable data."""
    cache = runner.encoder_cache
    held = sorted(i for i in identifiers if i in cache)
    return {
        "output": summary(output),
        "states": {rid: list(s.token_ids) for rid, s in runner.states.items()},
        "cache": {
            identifier: hashlib.sha256(cache.get(identifier).numpy().tobytes()).hexdigest()
            for identifier in held
        },
    }


def summary(output: ModelRunnerOutput) -> dict:
    return {
        "sampled": dict(output.sampled_token_ids),
        "errors": {rid: failure.kind.value for rid, failure in output.errors.items()},
        "logprobs": {
            rid: (lp.token_ids.tolist(), lp.logprobs.tolist())
            for rid, lp in output.logprobs.items()
        },
    }


def assert_same_answers(expected: dict, got: dict) -> None:
    """Two steps' `summary`s: the same tokens, failures and top-k ids; logprobs to float
    rounding (one device and the ranks may batch the vision tower's calls differently)."""
    assert got["sampled"] == expected["sampled"]
    assert got["errors"] == expected["errors"]
    assert got["logprobs"].keys() == expected["logprobs"].keys()
    for rid, (ids, values) in expected["logprobs"].items():
        assert got["logprobs"][rid][0] == ids, rid
        np.testing.assert_allclose(got["logprobs"][rid][1], values, rtol=1e-5, atol=1e-5)


def _encoder(runner: ModelRunner, embed: Any) -> EncoderRunner:
    """An encoder over `runner`'s (empty) cache, with `embed` and the tests' call budget."""
    return EncoderRunner(embed, runner.encoder_cache, max_patches_per_call=MAX_PATCHES_PER_CALL)
