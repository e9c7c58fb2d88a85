"""Two data-parallel replicas behind one engine: the same answers as one, repeated pictures
encoded about once, and the requests shared out."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmserve import LLM, SamplingParams
from mmserve.config.engine import EngineConfig
from mmserve.engine.frontend.async_engine import AsyncLLMEngine, build_async_engine
from mmserve.engine.frontend.outputs import OutputKind
from mmserve.engine.frontend.replicas import ReplicaSet
from tests.support.factory import png_bytes
from tests.support.harness import data_url, image_part, user

NUM_PICTURES = 8
SENDS_PER_PICTURE = 6
NUM_CLIENTS = 8
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def dp_engine(qwen2_vl_dir: Path) -> Iterator[AsyncLLMEngine]:
    config = EngineConfig.from_kwargs(
        model=str(qwen2_vl_dir), data_parallel_size=2, max_num_batched_tokens=256
    )
    engine = build_async_engine(config)
    try:
        yield engine
    finally:
        asyncio.run(engine.shutdown(timeout_s=5))


def _messages(seed: int, question: str = "What is in it?") -> list[dict]:
    return user(image_part(data_url(png_bytes(56, 56, seed=seed))), question)


async def _ask(engine: AsyncLLMEngine, messages: list[dict], request_id: str) -> list[int]:
    prompt = await engine.process_chat(messages)
    final = None
    async for out in engine.generate(prompt, PARAMS, request_id, output_kind=OutputKind.FINAL_ONLY):
        final = out
    assert final is not None and final.finished
    assert final.outputs[0].finish_reason == "length", final
    return list(final.outputs[0].token_ids)


def _encoded(engine: AsyncLLMEngine) -> list[int]:
    return [m.snapshot().counters["encoder_items_encoded"] for m in engine.metrics.replicas]


def test_answers_equal_the_single_replica_servers(
    qwen2_vl_dir: Path, dp_engine: AsyncLLMEngine
) -> None:
    conversations = [_messages(100 + i, f"Question {i}?") for i in range(6)]
    conversations.append(user("Tell me a story about a fox"))

    async def ask_all() -> list[list[int]]:
        calls = [_ask(dp_engine, m, f"same-{i}") for i, m in enumerate(conversations)]
        return await asyncio.gather(*calls)

    got = asyncio.run(ask_all())
    with LLM(model=str(qwen2_vl_dir), max_num_batched_tokens=256) as single:
        expected = [list(o.outputs[0].token_ids) for o in single.chat(conversations, PARAMS)]
    assert got == expected


def test_repeated_pictures_are_encoded_about_once_and_both_replicas_share_the_work(
    dp_engine: AsyncLLMEngine,
) -> None:
    """8 pictures x 6 sends, shuffled, 8 clients at once. Each picture is encoded once on the
    replica it is first routed to, and once more on a replica only when a load detour sends it
    to one that has not seen it: encodes <= 8 + detours (dp_routed_requests{reason="load"})."""
    core = dp_engine.engine.core
    assert isinstance(core, ReplicaSet)
    before_encoded = _encoded(dp_engine)
    before_requests = [s.num_requests for s in core.states()]
    before_routes = dict(dp_engine.metrics.snapshot().labelled_counters["dp_routed_requests"])
    sends = [p for p in range(NUM_PICTURES) for _ in range(SENDS_PER_PICTURE)]
    random.Random(5).shuffle(sends)

    async def run() -> None:
        work: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        for n, picture in enumerate(sends):
            work.put_nowait((n, picture))

        async def client() -> None:
            while not work.empty():
                n, picture = work.get_nowait()
                await _ask(dp_engine, _messages(picture), f"w-{n}")

        await asyncio.gather(*(client() for _ in range(NUM_CLIENTS)))

    asyncio.run(run())
    encoded = [a - b for a, b in zip(_encoded(dp_engine), before_encoded, strict=True)]
    requests = [s.num_requests - b for s, b in zip(core.states(), before_requests, strict=True)]
    routes = dp_engine.metrics.snapshot().labelled_counters["dp_routed_requests"]
    by_load = routes.get("load", 0) - before_routes.get("load", 0)
    by_affinity = routes.get("affinity", 0) - before_routes.get("affinity", 0)
    assert by_load + by_affinity == len(sends)
    assert sum(requests) == len(sends)
    for n in requests:
        assert 0.3 * len(sends) <= n <= 0.7 * len(sends), (requests, encoded, by_load)
    # every picture at least once; more only by a detour, and at most once per replica
    assert NUM_PICTURES <= sum(encoded) <= NUM_PICTURES + by_load, (encoded, by_load)
    assert sum(encoded) <= NUM_PICTURES * len(requests)
    print(f"encodes per replica {encoded}, requests {requests}, by load {by_load}")
