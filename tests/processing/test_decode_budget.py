"""Decode-memory caps: per request (400), server-wide in flight (FIFO wait, then 503)."""

from __future__ import annotations

import asyncio
import base64
import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mmserve.config.media import MediaConfig
from mmserve.errors import DecodeBusyError, ImageTooLargeError
from mmserve.processing.decode_budget import DecodeMemoryGate, RequestDecodeBudget
from mmserve.processing.input_processor import InputProcessor
from mmserve.processing.media import MediaLoader
from tests.support.factory import flat_png

GREY_100 = flat_png(100, 100, "L")
GREY_100_BYTES = 100 * 100 * (4 + 6) + (1 << 20)  # its estimate: RGB + packed copy, decoder


def _loader(**kwargs) -> MediaLoader:
    return MediaLoader(MediaConfig(**kwargs))


def _chat(num_images: int) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(GREY_100).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}} for _ in range(num_images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "same?"}]}]


def test_per_request_cap_sums_the_images_of_one_request() -> None:
    loader = _loader(max_decode_bytes_per_request=int(2.5 * GREY_100_BYTES))
    budget = loader.new_decode_budget()
    kept = [loader.load_image(GREY_100, budget) for _ in range(2)]
    with pytest.raises(ImageTooLargeError) as info:
        loader.load_image(GREY_100, budget)
    assert info.value.status_code == 400 and info.value.param == "image_url"
    assert "--max-decode-bytes-per-request" in info.value.message
    assert f"{3 * GREY_100_BYTES} bytes" in info.value.message
    assert loader.load_image(GREY_100).size == (100, 100)  # another request, its own budget
    assert len(kept) == 2


def test_per_request_cap_through_the_input_processor(tiny_checkpoint: Path) -> None:
    loader = _loader(max_decode_bytes_per_request=int(2.5 * GREY_100_BYTES))
    proc = InputProcessor.from_pretrained(tiny_checkpoint, media_loader=loader)
    assert len(proc.process_chat(_chat(2)).mm_features) == 2
    with pytest.raises(ImageTooLargeError, match="--max-decode-bytes-per-request"):
        proc.process_chat(_chat(3))
    with pytest.raises(ImageTooLargeError, match="--max-decode-bytes-per-request"):
        asyncio.run(proc.aprocess_chat(_chat(3)))
    assert len(asyncio.run(proc.aprocess_chat(_chat(2))).mm_features) == 2
    gc.collect()
    assert loader.decode_gate.in_use_bytes == 0  # every reservation given back after processing


@pytest.mark.parametrize("decode_workers", [0, 1])
def test_inflight_cap_makes_a_second_decode_wait_for_the_first_image(decode_workers: int) -> None:
    loader = _loader(
        max_decode_bytes_per_request=GREY_100_BYTES,
        max_inflight_decode_bytes=int(1.5 * GREY_100_BYTES),
        decode_wait_timeout=20,
        decode_workers=decode_workers,
        decode_timeout_s=60,
    )
    try:
        held = loader.load_image(GREY_100)
        assert loader.decode_gate.in_use_bytes == GREY_100_BYTES
        done = threading.Event()
        results = []

        def second() -> None:
            results.append(loader.load_image(GREY_100))
            done.set()

        thread = threading.Thread(target=second)
        thread.start()
        assert not done.wait(0.5)  # waiting for room, not decoding
        del held  # the first image is garbage: its bytes return to the gate
        assert done.wait(20)
        thread.join(5)
        assert results[0].size == (100, 100)
        results.clear()
        assert loader.decode_gate.in_use_bytes == 0
    finally:
        loader.close()


def test_a_decode_that_cannot_get_room_in_time_is_a_503() -> None:
    loader = _loader(
        max_decode_bytes_per_request=GREY_100_BYTES,
        max_inflight_decode_bytes=int(1.5 * GREY_100_BYTES),
        decode_wait_timeout=0.2,
    )
    held = loader.load_image(GREY_100)
    start = time.monotonic()
    with pytest.raises(DecodeBusyError) as info:
        loader.load_image(GREY_100)
    assert 0.2 <= time.monotonic() - start < 2
    assert info.value.status_code == 503 and info.value.code == "server_busy"
    assert "retry" in info.value.message
    assert loader.decode_gate.in_use_bytes == GREY_100_BYTES  # the waiter took nothing
    del held
    assert loader.decode_gate.in_use_bytes == 0


def test_an_image_over_the_inflight_cap_is_refused_at_once() -> None:
    loader = _loader(max_decode_bytes_per_request=1000, max_inflight_decode_bytes=1000)
    start = time.monotonic()
    with pytest.raises(ImageTooLargeError, match="--max-decode-bytes-per-request"):
        loader.load_image(GREY_100)
    gate = DecodeMemoryGate(1000, wait_timeout_s=30)
    with pytest.raises(ImageTooLargeError, match="--max-inflight-decode-bytes"):
        gate.reserve(1001)
    assert time.monotonic() - start < 1  # never waits for room that cannot exist


def test_gate_serves_waiters_first_come_first_served() -> None:
    gate = DecodeMemoryGate(100, wait_timeout_s=20)
    first = gate.reserve(60)
    order: list[str] = []
    releases = {}

    def wait_for(name: str, nbytes: int) -> None:
        releases[name] = gate.reserve(nbytes)
        order.append(name)

    big = threading.Thread(target=wait_for, args=("big", 80))
    big.start()
    time.sleep(0.2)  # big is queued first
    small = threading.Thread(target=wait_for, args=("small", 30))
    small.start()
    time.sleep(0.3)
    assert order == []  # small would fit (60 + 30 <= 100) but does not overtake big
    first()
    big.join(5)
    assert order == ["big"]
    time.sleep(0.2)
    assert order == ["big"]  # 80 + 30 > 100: small still waits
    releases["big"]()
    small.join(5)
    assert order == ["big", "small"]
    releases["small"]()
    releases["small"]()  # a release is idempotent
    assert gate.in_use_bytes == 0
    gate.check_integrity()


def test_randomised_reservations_from_many_threads_keep_the_count_exact() -> None:
    gate = DecodeMemoryGate(1000, wait_timeout_s=10)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        for i in range(50):
            try:
                release = gate.reserve(50 + (seed * 37 + i * 11) % 400)
                gate.check_integrity()
                release()
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and gate.in_use_bytes == 0


def test_request_budget_without_a_cap_only_counts() -> None:
    budget = RequestDecodeBudget(0)
    budget.charge(10**12)
    assert budget.used_bytes == 10**12


def test_caps_are_validated_naming_the_field_or_flag() -> None:
    with pytest.raises(ValueError, match="must not exceed --max-inflight-decode-bytes"):
        MediaConfig(max_decode_bytes_per_request=3, max_inflight_decode_bytes=2)
    with pytest.raises(ValueError, match="--decode-worker-max-rss-mb must be >= 0"):
        MediaConfig(decode_worker_max_rss_mb=-1)
    # 0 per request: the in-flight cap bounds a request too (it could never fit beyond it).
    assert MediaConfig(max_decode_bytes_per_request=0).decode_bytes_per_request_cap == 2 << 30
    with pytest.raises(ValueError, match="--max-decode-bytes-per-request .* must not exceed"):
        MediaConfig(max_decode_bytes_per_request=3 << 30)
    with pytest.raises(ValueError, match="--max-image-pixels must be positive"):
        MediaConfig(max_image_pixels=0)
    with pytest.raises(ValueError, match="--decode-worker-max-rss-mb must be >= 0"):
        MediaConfig(decode_worker_max_rss_mb=-5)


@pytest.mark.parametrize(("decode_workers", "entry"), [(0, "adecode"), (1, "aload_image")])
def test_async_decode_waits_for_room_without_holding_a_thread_or_a_worker(
    decode_workers: int, entry: str
) -> None:
    """One executor thread: the job that frees the held image must run while a decode waits.

    A decode that waited inside its thread would hold the only thread until its timeout.
    """
    loader = _loader(
        max_decode_bytes_per_request=GREY_100_BYTES,
        max_inflight_decode_bytes=int(1.5 * GREY_100_BYTES),
        decode_wait_timeout=20,
        decode_workers=decode_workers,
        decode_timeout_s=60,
    )
    held = [loader.load_image(GREY_100)]

    async def scenario() -> tuple[float, tuple[int, int]]:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=1))
        url = "data:image/png;base64," + base64.b64encode(GREY_100).decode()
        load = loader.adecode(GREY_100) if entry == "adecode" else loader.aload_image(url)
        waiting = asyncio.create_task(load)
        deadline = time.monotonic() + 10
        while loader.decode_gate.num_waiting == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert loader.decode_gate.num_waiting == 1 and not waiting.done()
        if decode_workers:  # the only decode process is free while the decode waits
            other = await asyncio.to_thread(loader._pool.decode, flat_png(8, 8, "L"), 10**6)
            assert other.size == (8, 8)
        start = time.monotonic()
        await asyncio.to_thread(held.clear)  # "processing" finishes on the only thread
        image = await asyncio.wait_for(waiting, 20)
        return time.monotonic() - start, image.size

    try:
        elapsed, size = asyncio.run(scenario())
    finally:
        loader.close()
    assert size == (100, 100) and elapsed < 5
    gc.collect()
    assert loader.decode_gate.in_use_bytes == 0


def test_async_decode_times_out_with_a_503_and_gives_way_when_cancelled() -> None:
    loader = _loader(
        max_decode_bytes_per_request=GREY_100_BYTES,
        max_inflight_decode_bytes=int(1.5 * GREY_100_BYTES),
        decode_wait_timeout=0.3,
    )
    held = loader.load_image(GREY_100)

    async def scenario() -> None:
        with pytest.raises(DecodeBusyError):
            await loader.adecode(GREY_100)
        waiting = asyncio.create_task(loader.adecode(GREY_100))
        await asyncio.sleep(0.1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(scenario())
    assert loader.decode_gate.num_waiting == 0
    assert loader.decode_gate.in_use_bytes == GREY_100_BYTES  # only the held image
    del held
    assert loader.decode_gate.in_use_bytes == 0
    loader.decode_gate.check_integrity()
