"""Requests take turns at the API process's CPU work, in arrival order, a bounded number at
once; fetching happens before a request queues, so a slow media server holds no turn."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import pytest

from mmserve.config.media import MediaConfig
from mmserve.cpu_threads import usable_cpus
from mmserve.processing.input_processor import InputProcessor
from mmserve.processing.media import MediaLoader
from mmserve.processing.processing_turns import ProcessingTurns
from tests.support.factory import random_image

SLOW_URL = "http://media.example/slow.png"


def _url(seed: int) -> str:
    out = io.BytesIO()
    random_image(64, 48, seed=seed).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _messages(url: str, text: str) -> list[dict]:
    image = {"type": "image_url", "image_url": {"url": url}}
    return [{"role": "user", "content": [image, {"type": "text", "text": text}]}]


def test_turns_refuse_a_count_below_one() -> None:
    with pytest.raises(ValueError, match="processing turns must be >= 1, got 0"):
        ProcessingTurns(0)


@pytest.mark.parametrize("count", [1, 2])
def test_turns_are_taken_in_arrival_order_and_bounded(count: int) -> None:
    turns = ProcessingTurns(count)
    entered: list[int] = []
    inside, most_inside = 0, 0

    async def request(i: int) -> None:
        nonlocal inside, most_inside
        async with turns.turn():
            entered.append(i)
            inside += 1
            most_inside = max(most_inside, inside)
            for _ in range(3):  # hold the turn over a few loop iterations
                await asyncio.sleep(0)
            inside -= 1

    async def main() -> None:
        await asyncio.gather(*(request(i) for i in range(8)))

    asyncio.run(main())
    assert entered == list(range(8))
    assert most_inside == count


def test_a_request_that_leaves_the_queue_gives_its_place_up() -> None:
    turns = ProcessingTurns(1)
    order: list[str] = []

    async def main() -> None:
        holder_in, release = asyncio.Event(), asyncio.Event()

        async def holder() -> None:
            async with turns.turn():
                holder_in.set()
                await release.wait()
                order.append("holder")

        async def waiter(name: str) -> None:
            async with turns.turn():
                order.append(name)

        first = asyncio.ensure_future(holder())
        await holder_in.wait()
        gone, after = asyncio.ensure_future(waiter("gone")), asyncio.ensure_future(waiter("after"))
        await asyncio.sleep(0)
        gone.cancel()
        release.set()
        await asyncio.gather(first, after)
        assert gone.cancelled()

    asyncio.run(main())
    assert order == ["holder", "after"]


@pytest.mark.parametrize(
    ("modalities", "waits"),
    [([], False), (["video"], False), (["image", "video"], False), (["image", "image"], True)],
)
def test_only_requests_with_images_and_no_video_take_turns(
    modalities: list[str], waits: bool
) -> None:
    """Text alone has nothing costly to order; a video's decode would hold the queue."""
    turns = ProcessingTurns(1)

    async def main() -> bool:
        held, release = asyncio.Event(), asyncio.Event()

        async def holder() -> None:
            async with turns.turn(["image"]):
                held.set()
                await release.wait()

        first = asyncio.ensure_future(holder())
        await held.wait()
        entered = asyncio.Event()

        async def other() -> None:
            async with turns.turn(modalities):
                entered.set()

        second = asyncio.ensure_future(other())
        for _ in range(5):
            await asyncio.sleep(0)
        went_at_once = entered.is_set()
        release.set()
        await asyncio.gather(first, second)
        return went_at_once

    assert asyncio.run(main()) is not waits


def test_turns_serve_one_event_loop_after_another() -> None:
    """An asyncio.Semaphore belongs to the first loop that waits on it; each loop gets its own."""
    turns = ProcessingTurns(1)

    async def contended() -> int:
        done = 0

        async def one() -> None:
            nonlocal done
            async with turns.turn():
                await asyncio.sleep(0)
                done += 1

        await asyncio.gather(one(), one(), one())
        return done

    assert asyncio.run(contended()) == 3
    assert asyncio.run(contended()) == 3


class StallingLoader(MediaLoader):
    """Fetches of SLOW_URL wait until the test lets them go; every other read is the real one.
    Records when each request's image is decoded (its turn's first CPU stage)."""

    def __init__(self, config: MediaConfig) -> None:
        super().__init__(config)
        self.slow_fetch_started = asyncio.Event()
        self.let_go = asyncio.Event()
        self.decoded: list[bytes] = []

    async def aread(self, source, what):
        if source == SLOW_URL:
            self.slow_fetch_started.set()
            await self.let_go.wait()
            return base64.b64decode(_url(99).split(",", 1)[1])
        return await super().aread(source, what)

    async def adecode(self, data, budget=None):
        self.decoded.append(data)
        return await super().adecode(data, budget)


def _processor(checkpoint: Path, loader: MediaLoader) -> InputProcessor:
    return InputProcessor.from_pretrained(checkpoint, max_model_len=4096, media_loader=loader)


def test_the_server_path_processes_requests_in_arrival_order(qwen2_vl_dir: Path) -> None:
    """In-process decoding: one turn, so each request's decode and processing finish before
    the next request's begin, in the order the requests came."""
    loader = StallingLoader(MediaConfig())
    proc = _processor(qwen2_vl_dir, loader)
    assert proc.turns.count == 1
    events: list[tuple[str, int]] = []
    process = proc._process_items

    def recording(prompt, items, cfg, namespace):
        index = int(prompt.split("request ")[1].split(".")[0])
        events.append(("start", index))
        out = process(prompt, items, cfg, namespace)
        events.append(("end", index))
        return out

    proc._process_items = recording

    async def main() -> list:
        return await asyncio.gather(
            *(proc.aprocess_chat(_messages(_url(i), f"request {i}.")) for i in range(4))
        )

    prompts = asyncio.run(main())
    assert events == [(kind, i) for i in range(4) for kind in ("start", "end")]
    assert all(p.mm_features for p in prompts)


def test_a_slow_fetch_holds_no_turn(qwen2_vl_dir: Path) -> None:
    """A request still fetching its image does not keep a later request (inline image) from
    being processed: fetching comes before the turn."""
    loader = StallingLoader(MediaConfig())
    proc = _processor(qwen2_vl_dir, loader)
    assert proc.turns.count == 1

    async def main() -> None:
        slow = asyncio.ensure_future(proc.aprocess_chat(_messages(SLOW_URL, "slow")))
        await loader.slow_fetch_started.wait()
        inline = await asyncio.wait_for(proc.aprocess_chat(_messages(_url(1), "inline")), 60)
        assert inline.mm_features and not slow.done()
        loader.let_go.set()
        assert (await slow).mm_features

    asyncio.run(main())
    assert len(loader.decoded) == 2


def test_a_server_takes_a_turn_per_cpu(qwen2_vl_dir: Path) -> None:
    """Decoding in worker processes (a server): one request per CPU in its CPU stages."""
    loader = MediaLoader(MediaConfig(decode_workers=2))
    try:
        assert _processor(qwen2_vl_dir, loader).turns.count == usable_cpus()
    finally:
        loader.close()
