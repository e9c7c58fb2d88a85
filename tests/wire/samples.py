"""Wire messages of every type, full and empty, and a deep equality that compares arrays."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np

from mmserve.config.resolved import ResolvedConfig
from mmserve.config.scheduler import SchedulerConfig
from mmserve.errors import FailureKind, RequestFailure
from mmserve.metrics import SchedulerStats
from mmserve.multimodal import EncoderInput, MultiModalFeature, PlaceholderRange, RemoteItem
from mmserve.sampling_params import SamplingParams
from mmserve.structured_output.params import StructuredOutputParams
from mmserve.updates import Logprobs, RequestStatus, RequestUpdate
from mmserve.wire import (
    MESSAGE_TAGS,
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreShutdown,
    EngineDead,
    Message,
)
from tests.support.factory import CLIP_NORMALIZATION, CLIP_VIDEO_NORMALIZATION, uint8_patches
from tests.wire.executor_samples import executor_messages

PATCH_DIM = 1176  # C * T * P * P of Qwen2-VL: 3 * 2 * 14 * 14


def identifier(i: int) -> str:
    return f"{i:064x}"  # the width of a blake3 hex digest


def positions(num_tokens: int, delta: int = 0) -> np.ndarray:
    row = np.arange(num_tokens, dtype=np.int64) + delta
    return np.stack([row, row // 2, row % 7])  # [3, num_tokens] int64, rows differ


def pixels(grid_thw: tuple[int, int, int], seed: int) -> np.ndarray:
    t, h, w = grid_thw
    return uint8_patches(t * h * w, PATCH_DIM, seed)  # [patches, patch_dim] uint8


def feature(
    i: int, offset: int, grid_thw: tuple[int, int, int] = (1, 4, 6), *, is_remote: bool = False
) -> MultiModalFeature:
    t, h, w = grid_thw
    placeholder = PlaceholderRange(offset, t * h * w // 4)
    return MultiModalFeature(identifier(i), "image", placeholder, grid_thw, is_remote)


def encoder_input(f: MultiModalFeature, seed: int = 0) -> EncoderInput:
    return EncoderInput(pixels(f.grid_thw, seed), f.grid_thw, CLIP_NORMALIZATION)


def engine_core_request(num_images: int = 2, *, with_pixels: bool = True) -> EngineCoreRequest:
    features = [feature(i, offset=3 + 10 * i) for i in range(num_images)]
    num_tokens = 3 + 10 * num_images + 5
    return EngineCoreRequest(
        request_id="chatcmpl-1",
        prompt_token_ids=[(17 * i) % 1000 for i in range(num_tokens)],
        mm_features=features,
        encoder_inputs=(
            {f.identifier: encoder_input(f, i) for i, f in enumerate(features)}
            if with_pixels
            else {}
        ),
        sampling_params=SamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            seed=-(2**63) + 5,
            max_tokens=None,
            min_tokens=2,
            stop=("\n\n", "END"),
            stop_token_ids=(151645,),
            include_stop_str_in_output=True,
            structured_outputs=StructuredOutputParams(
                "json_schema", '{"type": "object", "properties": {"ok": {"type": "boolean"}}}'
            ),
            logprobs=5,
            presence_penalty=0.5,
            frequency_penalty=-1.0,
            repetition_penalty=1.3,
            logit_bias={151645: -100.0, 7: 2.5},
        ),
        mrope_positions=positions(num_tokens, delta=-3),
        mrope_position_delta=-3,
        eos_token_ids=(151643, 151645),
        cache_salt="tenant-a",
        arrival_time_s=12345.678,
    )


def video_and_image_request() -> EngineCoreRequest:
    """An image then a 4-frame video (grid_t 2) with its seconds per temporal patch."""
    img = feature(0, offset=3)
    placeholder = PlaceholderRange(img.placeholder.end + 2, 2 * 4 * 6 // 4)
    vid = MultiModalFeature(identifier(1), "video", placeholder, (2, 4, 6))
    num_tokens = vid.placeholder.end + 5
    inputs = {
        img.identifier: encoder_input(img, 0),
        vid.identifier: EncoderInput(
            pixels(vid.grid_thw, 1), vid.grid_thw, CLIP_VIDEO_NORMALIZATION, 1.0
        ),
    }
    return EngineCoreRequest(
        "chatcmpl-v",
        [(13 * i) % 1000 for i in range(num_tokens)],
        [img, vid],
        inputs,
        SamplingParams(temperature=0.0),
        positions(num_tokens, delta=-9),
        -9,
        None,
        None,
        1.5,
    )


def remote_items_request() -> EngineCoreRequest:
    """A disaggregated server's request: an inline file, an RGB array and a URL for the pool."""
    features = [feature(i, offset=3 + 10 * i, is_remote=True) for i in range(3)]
    rgb = np.arange(6 * 4 * 3, dtype=np.uint8)  # a 6x4 picture, packed [H, W, 3]
    sources = [
        ("bytes", np.frombuffer(b"\x89PNG\r\n\x1a\n" * 9, np.uint8), None, None),
        ("rgb", rgb, None, (6, 4)),
        ("url", None, "https://images.example/cat.png", None),
    ]
    items = {
        f.identifier: RemoteItem(source, payload, url, size, 3136, 1003520, f.grid_thw, "ab" * 32)
        for f, (source, payload, url, size) in zip(features, sources, strict=True)
    }
    num_tokens = features[-1].placeholder.end + 4
    return EngineCoreRequest(
        "chatcmpl-remote",
        [(11 * i) % 1000 for i in range(num_tokens)],
        features,
        {},
        SamplingParams(temperature=0.0),
        positions(num_tokens),
        0,
        None,
        None,
        2.5,
        items,
    )


def engine_stats(**overrides) -> SchedulerStats:
    fields = dict(
        num_running=16,
        num_waiting=3,
        num_free_kv_blocks=900,
        encoder_cache_used_slots=256,
        encoder_cache_used_bytes=256 * 7168,
        encoder_cache_resident_slots=1024,
        prefix_cache_queries=10_000,
        prefix_cache_hits=2_500,
        encoder_cache_queries=40,
        encoder_cache_hits=10,
        counters={"encoder_items_encoded": 30, "encoder_forward_calls": 12},
        gauges={"kv_blocks_total": 1000.0},
        modality_counters={
            "encoder_items_encoded": {"image": 26, "video": 4},
            "encoder_forward_calls": {"image": 9, "video": 3},
        },
    )
    return SchedulerStats(**{**fields, **overrides})


def logprobs(num_tokens: int, num_top: int) -> Logprobs:
    rng = np.random.default_rng(num_tokens * 31 + num_top)
    ids = rng.integers(0, 151_000, (num_tokens, 1 + num_top)).astype(np.int32)
    values = -rng.random((num_tokens, 1 + num_top)).astype(np.float32)
    return Logprobs(ids, values, np.arange(1, num_tokens + 1, dtype=np.int32))


def all_messages() -> list[tuple[str, Message]]:
    """(name, message) covering every message type, each full and empty where it can be."""
    failure = RequestFailure("4 embeddings for 5 placeholders", FailureKind.REQUEST, "messages")
    stopped, length = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH
    error = RequestStatus.FINISHED_ERROR
    outputs = [
        RequestUpdate("r0", [5, 6], num_cached_tokens=32, first_scheduled_time_s=12345.9),
        RequestUpdate("r1", [7], stopped, stop_reason=151645),
        RequestUpdate("r2", [], length),
        RequestUpdate("r3", [], RequestStatus.FINISHED_ABORTED),
        RequestUpdate("r4", [], error, error=failure),
        RequestUpdate("r5", [], error, error=RequestFailure("boom", FailureKind.INTERNAL)),
        RequestUpdate("r6#0", [8, 9], logprobs=logprobs(2, 5)),
        RequestUpdate("r6#1", [10], length, logprobs=logprobs(1, 0)),
    ]
    messages: list[tuple[str, Message]] = [
        ("request_two_images", engine_core_request(2)),
        ("request_text_only", engine_core_request(0)),
        ("request_video_and_image", video_and_image_request()),
        ("request_images_held", engine_core_request(2, with_pixels=False)),
        ("request_remote_items", remote_items_request()),
        (
            "request_minimal",
            EngineCoreRequest("r", [], [], {}, SamplingParams(), None, 0, None, None, 0.0),
        ),
        (
            "request_empty_arrays",
            EngineCoreRequest("r", [], [], {}, SamplingParams(), positions(0), 0, (), "", 0.0),
        ),
        ("abort", EngineCoreAbort(["a", "b"])),
        ("abort_none", EngineCoreAbort([])),
        ("shutdown", EngineCoreShutdown()),
        ("outputs", EngineCoreOutputs(outputs, engine_stats())),
        ("outputs_none", EngineCoreOutputs([])),
        (
            "outputs_stats_zero",
            EngineCoreOutputs(
                [],
                engine_stats(
                    counters={}, gauges={}, modality_counters={}, num_running=0, num_waiting=0
                ),
            ),
        ),
        ("dead", EngineDead("the engine core exited with signal 9")),
        (
            "ready",
            EngineCoreReady(
                ResolvedConfig(
                    model="/m",
                    architecture="Qwen2VLForConditionalGeneration",
                    device="cuda",
                    dtype="bfloat16",
                    max_model_len=256,
                    num_kv_blocks=128,
                    kv_cache_bytes=128 * 16 * 4096,
                    block_size=16,
                    enable_prefix_caching=True,
                    max_num_batched_tokens=2048,
                    max_num_seqs=256,
                    max_tokens_per_mm_item=64,
                    max_patches_per_mm_item=256,
                    encoder_cache_slots=2048,
                    encoder_cache_bytes=2048 * 3072,
                    encoder_patch_budget=8192,
                    chunked_mm_input=True,
                    attention_backend="triton",
                    layer_ops="triton",
                    encoder_cuda_graph=True,
                    cuda_graph_sizes=(1, 2, 4, 8, 16),
                ),
                SchedulerConfig(max_model_len=256, encoder_embed_bytes=3072),
            ),
        ),
    ]
    messages += executor_messages(engine_core_request(2), remote_items_request(), logprobs)
    assert {type(m) for _, m in messages} == set(MESSAGE_TAGS), "a message type has no sample"
    return messages


def assert_same(a: object, b: object, path: str = "$") -> None:
    """Deep equality: struct types and fields, containers, arrays by dtype, shape and values."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, msgspec.Struct):
        for name in a.__struct_fields__:
            assert_same(getattr(a, name), getattr(b, name), f"{path}.{name}")
    elif dataclasses.is_dataclass(a):  # the step and its answer (scheduling/outputs.py)
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (
            f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        )
        assert np.array_equal(a, b), f"{path}: array values differ"
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
