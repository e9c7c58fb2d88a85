"""Cost of the wire codec on a typical engine step, and of moving it through a ZMQ socket.

Usage: .venv/bin/python benchmarks/wire_codec.py [--repeats 2000] [--no-zmq]

Messages: the EngineCoreRequest of a request carrying a 448x448 image (grid 1x32x32: 1024
patches x 1176 uint8 levels = 1.2 MB, 256 placeholder tokens, 32 text tokens); the EngineCoreOutputs
of sixteen one-token updates. For each: median microseconds to
encode, to decode and for the round trip, frame count and bytes (frame 0 = header + msgpack).
Then token ids as msgpack ints against a raw int32 frame, and a round trip over a zmq PAIR
socket on ipc:// (send_multipart with copy=False, recv_multipart with copy=False).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mmserve.multimodal import EncoderInput, MultiModalFeature, PlaceholderRange  # noqa: E402
from mmserve.processing.image_processor import ImageProcessorConfig  # noqa: E402
from mmserve.sampling_params import SamplingParams  # noqa: E402
from mmserve.updates import RequestUpdate  # noqa: E402
from mmserve.wire import (  # noqa: E402
    EngineCoreOutputs,
    EngineCoreRequest,
    decode,
    encode,
)

GRID = (1, 32, 32)  # 448x448 at patch 14
NUM_EMBEDS = 256  # 1024 patches merged 2x2
NUM_TEXT = 32
NUM_DECODES = 16


def _positions(num_tokens: int) -> np.ndarray:
    return np.tile(np.arange(num_tokens, dtype=np.int64), (3, 1))  # [3, num_tokens]


def _image_request_parts():
    num_prompt = NUM_EMBEDS + NUM_TEXT
    feature = MultiModalFeature("ab" * 32, "image", PlaceholderRange(4, NUM_EMBEDS), GRID)
    pixels = np.random.default_rng(0).integers(0, 256, (1024, 1176), dtype=np.uint8)
    encoder_input = EncoderInput(pixels, GRID, ImageProcessorConfig().image_normalization)
    tokens = [151655 if 4 <= i < 4 + NUM_EMBEDS else 1000 + i for i in range(num_prompt)]
    return tokens, feature, encoder_input


def messages() -> dict[str, object]:
    tokens, feature, encoder_input = _image_request_parts()
    params = SamplingParams(temperature=0.0, max_tokens=32)
    request = EngineCoreRequest(
        "chatcmpl-new",
        tokens,
        [feature],
        {feature.identifier: encoder_input},
        params,
        _positions(len(tokens)),
        0,
        None,
        None,
        time.monotonic(),
    )
    outputs = EngineCoreOutputs(
        [RequestUpdate(f"chatcmpl-{i}", [1000 + i]) for i in range(NUM_DECODES)]
    )
    return {
        "engine-core request: 448x448 image, 288 tokens": request,
        "engine-core outputs: 16 one-token deltas": outputs,
    }


class Timing(NamedTuple):
    median_us: float
    best_us: float  # the steadier figure on a busy host

    def __str__(self) -> str:
        return f"{self.median_us:.1f}/{self.best_us:.1f}"


def _time_us(fn, repeats: int) -> Timing:
    for _ in range(min(50, repeats)):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return Timing(statistics.median(times) * 1e6, min(times) * 1e6)


def bench_codec(repeats: int) -> None:
    print("microseconds as median/best of --repeats runs")
    print(
        f"{'message':<58} {'encode us':>11} {'decode us':>11} {'round trip':>11} {'frames':>6} "
        f"{'frame0 B':>8} {'total B':>9}"
    )
    for name, msg in messages().items():
        frames = encode(msg)
        sizes = [memoryview(f).nbytes for f in frames]
        enc = _time_us(lambda msg=msg: encode(msg), repeats)
        dec = _time_us(lambda frames=frames: decode(frames), repeats)
        rt = _time_us(lambda msg=msg: decode(encode(msg)), repeats)
        print(
            f"{name:<58} {enc!s:>11} {dec!s:>11} {rt!s:>11} {len(frames):6d} {sizes[0]:8d} "
            f"{sum(sizes):9d}"
        )


def bench_token_ids(repeats: int) -> None:
    """Prompt token ids both ways; the receiver wants a list[int] (the scheduler's type)."""
    tokens, _, _ = _image_request_parts()
    decoder = msgspec.msgpack.Decoder(list[int])

    def as_ints() -> list[int]:
        return decoder.decode(msgspec.msgpack.encode(tokens))

    def as_frame() -> list[int]:
        frame = np.asarray(tokens, dtype=np.int32).data
        return np.frombuffer(frame, dtype=np.int32).tolist()

    assert as_ints() == as_frame() == tokens
    ints_us, frame_us = _time_us(as_ints, repeats), _time_us(as_frame, repeats)
    print(
        f"token ids ({len(tokens)}), list[int] out: msgpack ints {ints_us} us, "
        f"raw int32 frame {frame_us} us"
    )


def bench_zmq(repeats: int) -> None:
    import zmq

    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{os.path.join(tmp, 'wire')}"
        server, client = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        server.bind(address)
        client.connect(address)
        for name, msg in messages().items():

            def round_trip(msg=msg):
                client.send_multipart(encode(msg), copy=False)
                return decode(server.recv_multipart(copy=False))

            n = max(repeats // 10, 20)
            print(f"zmq ipc send+recv+codec, {name}: {_time_us(round_trip, n)} us")
        client.close(0)
        server.close(0)
    ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--no-zmq", action="store_true")
    args = parser.parse_args()
    bench_codec(args.repeats)
    bench_token_ids(args.repeats)
    if not args.no_zmq:
        bench_zmq(args.repeats)


if __name__ == "__main__":
    main()
