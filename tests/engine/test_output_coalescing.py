"""A stream whose reader fell behind gets its waiting updates as one: the same text, ids,
logprobs and finish as update by update, in fewer chunks (vLLM's output collector)."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import numpy as np
import pytest

from mmserve import LLM, SamplingParams
from mmserve.engine.frontend.async_engine import AsyncLLMEngine
from mmserve.engine.frontend.output_processor import OutputProcessor
from mmserve.engine.frontend.output_stream import OutputStream
from mmserve.engine.frontend.outputs import OutputKind, RequestOutput, merge_update
from mmserve.errors import InvalidRequestError
from mmserve.metrics import EngineMetrics
from mmserve.updates import Logprobs, RequestStatus, RequestUpdate

LENGTH = RequestStatus.FINISHED_LENGTH


def _decode(ids, skip_special_tokens: bool) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def _lp(*tokens: int) -> Logprobs:
    return Logprobs(
        np.array([[t] for t in tokens], dtype=np.int32),
        np.array([[-0.5 * t] for t in tokens], dtype=np.float32),
        np.ones(len(tokens), "i4"),
    )


# Three steps of a request with two samples, logprobs and prompt logprobs: sample 1 finishes
# in the second step, so the third carries sample 0 alone (a DELTA update holds only what
# changed).
STEPS = [
    [
        RequestUpdate("p#0", [0], logprobs=_lp(0), prompt_logprobs=_lp(2, 3)),
        RequestUpdate("p#1", [1], logprobs=_lp(1)),
    ],
    [
        RequestUpdate("p#0", [2], logprobs=_lp(2)),
        RequestUpdate("p#1", [3], LENGTH, logprobs=_lp(3)),
    ],
    [RequestUpdate("p#0", [4], LENGTH, logprobs=_lp(4))],
]


def _processor(kind: OutputKind) -> OutputProcessor:
    op = OutputProcessor(_decode, EngineMetrics())
    params = SamplingParams(n=2, logprobs=0, prompt_logprobs=0)
    op.add_request("p", None, [1, 2, 3], params, kind, ["p#0", "p#1"])
    return op


def _by_step(kind: OutputKind) -> list[RequestOutput]:
    op = _processor(kind)
    return [out for updates in STEPS for out in op.process(updates).outputs]


def _at_once(kind: OutputKind) -> RequestOutput:
    (out,) = _processor(kind).process([u for updates in STEPS for u in updates]).outputs
    return out


@pytest.mark.parametrize("kind", [OutputKind.DELTA, OutputKind.CUMULATIVE])
def test_merged_updates_say_what_the_steps_said_at_once(kind: OutputKind) -> None:
    first, *rest = _by_step(kind)
    merged = functools.reduce(lambda a, b: merge_update(a, b, kind), rest, first)
    # the same as one batch of every step's updates, processed in one go
    assert merged == _at_once(kind)
    assert merged.finished
    s0, s1 = merged.outputs
    assert (s0.index, s0.delta_text, s0.num_tokens, s0.finish_reason) == (0, "ace", 3, "length")
    assert (s1.index, s1.delta_text, s1.num_tokens, s1.finish_reason) == (1, "bd", 2, "length")
    assert [list(e) for e in s0.logprobs] == [[0], [2], [4]]
    assert s0.cumulative_logprob == pytest.approx(-3.0)


def test_a_delta_merge_keeps_the_prompt_logprobs_of_the_first_update() -> None:
    first, second, third = _by_step(OutputKind.DELTA)
    assert first.prompt_logprobs is not None and second.prompt_logprobs is None
    assert [c.index for c in third.outputs] == [0]
    merged = merge_update(merge_update(first, second, OutputKind.DELTA), third, OutputKind.DELTA)
    assert merged.prompt_logprobs is first.prompt_logprobs
    # a sample only the earlier update changed is kept: sample 1 was not in the third step
    assert [(c.index, c.finish_reason) for c in merged.outputs] == [(0, "length"), (1, "length")]


@pytest.mark.anyio
async def test_a_stream_merges_waiting_updates_but_never_an_error() -> None:
    first, second, third = _by_step(OutputKind.DELTA)
    stream = OutputStream(asyncio.get_running_loop(), OutputKind.DELTA)
    error = InvalidRequestError("boom")
    for item in (first, second, error, third):
        stream.push(item)
    merged = await stream.get()
    assert [c.text for c in merged.outputs] == ["ac", "bd"]
    assert await stream.get() is error
    assert await stream.get() is third
    # and a reader waiting on an empty stream is woken by the next update, from any thread
    waiting = asyncio.ensure_future(stream.get())
    await asyncio.sleep(0)
    await asyncio.to_thread(stream.put, first)
    assert await asyncio.wait_for(waiting, 10) is first


@pytest.mark.anyio
async def test_a_reader_that_fell_behind_gets_the_rest_in_one_or_two_chunks(
    qwen2_vl_dir: Path,
) -> None:
    llm = LLM(model=str(qwen2_vl_dir), num_gpu_blocks_override=64)
    engine = AsyncLLMEngine(llm.engine, llm.config, model_name="tiny")
    try:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        prompt = await engine.process_prompt("Once upon a time")
        updates = engine.generate(prompt, params, "one", output_kind=OutputKind.DELTA)
        steady = [u async for u in updates]
        assert len(steady) >= 2 and steady[-1].finished

        slow = engine.generate(prompt, params, "two", output_kind=OutputKind.DELTA)
        chunks = [await anext(slow)]
        # the reader is busy until the engine has finished the request: every later step's
        # update waits in the stream (the last may still be on its way to the loop)
        for _ in range(6000):
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        chunks += [u async for u in slow]
        assert 2 <= len(chunks) <= 3 and chunks[-1].finished
        assert len(steady) > len(chunks)
        assert "".join(u.outputs[0].text for u in chunks) == "".join(
            u.outputs[0].text for u in steady
        )
        ids = [[t for u in run for t in u.outputs[0].token_ids] for run in (steady, chunks)]
        assert ids[0] == ids[1] and len(ids[0]) == 16
        assert chunks[-1].outputs[0].num_tokens == 16
        assert chunks[-1].outputs[0].finish_reason == "length"
    finally:
        await engine.shutdown(timeout_s=1.0)
