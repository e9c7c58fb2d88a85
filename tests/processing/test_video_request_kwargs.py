"""Per-request video sampling through the InputProcessor: mm_processor_kwargs and vLLM's
media_io_kwargs, bounded by the server's ceilings, and each choice in the video's identity."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest

from mmserve.config.media import MediaConfig
from mmserve.errors import InvalidRequestError
from mmserve.processing.input_processor import InputProcessor
from mmserve.processing.media import MediaLoader
from mmserve.processing.video_inputs import split_processor_kwargs, video_request_kwargs
from tests.support.factory import video_bytes, video_frames

SMALL = {"min_pixels": 3136, "max_pixels": 3136}  # 32x32 frames -> 56x56: 4 tokens per pair
CLIP = video_bytes(16, 32, 32, fps=8, seed=3)  # 2 s
URL = "data:video/mp4;base64," + base64.b64encode(CLIP).decode()


@pytest.fixture
def processor(qwen2_5_vl_dir: Path) -> InputProcessor:
    return InputProcessor.from_pretrained(
        qwen2_5_vl_dir, max_model_len=4096, mm_processor_cache_gb=0.05
    )


def _chat(processor: InputProcessor, **kwargs: object):
    parts = [{"type": "video_url", "video_url": {"url": URL}}, {"type": "text", "text": "hi"}]
    messages = [{"role": "user", "content": parts}]
    return asyncio.run(processor.aprocess_chat(messages, **kwargs))


def _video(processor: InputProcessor, mm: dict | None = None, io: dict | None = None):
    prompt = _chat(processor, mm_processor_kwargs={**SMALL, **(mm or {})}, media_io_kwargs=io)
    feature = prompt.mm_features[0]
    return feature, prompt.mm_data[feature.identifier]


def test_fps_above_the_engine_rate_samples_more_frames(processor: InputProcessor) -> None:
    """2 s clip: the engine's 2 fps keeps 4 frames (2 temporal patches of 4 tokens); fps 4
    keeps 8 (4 patches), asked in mm_processor_kwargs or in media_io_kwargs alike."""
    default, _ = _video(processor)
    fps4, data = _video(processor, {"fps": 4})
    assert (default.grid_thw, fps4.grid_thw) == ((2, 4, 4), (4, 4, 4))
    assert (default.placeholder.length, fps4.placeholder.length) == (8, 16)
    assert data.second_per_grid_t == pytest.approx(0.5)  # 8 frames over 2 s, 2 per patch
    via_io, _ = _video(processor, io={"video": {"fps": 4}})
    assert via_io.identifier == fps4.identifier
    counted, _ = _video(processor, io={"video": {"num_frames": 12}})
    assert counted.grid_thw == (6, 4, 4)
    capped, _ = _video(processor, {"fps": 30, "max_frames": 10})
    assert capped.grid_thw == (5, 4, 4)  # 16 frames at fps 30, capped at 10


def test_identity_follows_the_frames_kept(processor: InputProcessor) -> None:
    fps1, _ = _video(processor, {"fps": 1})
    fps4, _ = _video(processor, {"fps": 4})
    assert fps1.identifier != fps4.identifier
    assert fps1.placeholder.length != fps4.placeholder.length
    queries, hits = processor.cache.stats.queries, processor.cache.stats.hits
    again, _ = _video(processor, {"fps": 4})
    assert again.identifier == fps4.identifier  # same video, same arguments: a cache hit
    assert (processor.cache.stats.queries, processor.cache.stats.hits) == (queries + 1, hits + 1)
    # fps 1 and 2 both keep min_frames 4 of this clip: the same frames, the same identity
    fps2, _ = _video(processor, {"fps": 2})
    assert fps2.identifier == fps1.identifier
    # num_frames 8 keeps the frames fps 4 keeps (and spaces them the same): one identity
    eight, _ = _video(processor, io={"video": {"num_frames": 8}})
    assert eight.identifier == fps4.identifier


def test_a_request_fps_times_given_frames(processor: InputProcessor) -> None:
    """Frames given as a list are kept as given; fps says how far apart they were taken, so
    it moves Qwen2.5-VL's temporal positions and belongs to the identity."""
    frames = video_frames(4, 32, 32, seed=5)

    def generate(**kwargs: object):
        prompt = {
            "prompt": "<|vision_start|><|video_pad|><|vision_end|>hi",
            "multi_modal_data": {"video": frames},
            "mm_processor_kwargs": {**SMALL, **kwargs},
        }
        return processor.process_generate_input(prompt)

    default, slow, fast = generate(), generate(fps=1), generate(fps=4)
    seconds = [p.mm_data[p.mm_features[0].identifier].second_per_grid_t for p in (slow, fast)]
    assert seconds == [2.0, 0.5]
    assert len({p.mm_features[0].identifier for p in (default, slow, fast)}) == 3
    assert default.prompt_token_ids == slow.prompt_token_ids == fast.prompt_token_ids
    assert (slow.mrope_positions != fast.mrope_positions).any()
    with pytest.raises(InvalidRequestError, match="kept as given"):
        generate(num_frames=2)


def test_the_fps_ceiling_is_the_flag(qwen2_vl_dir: Path) -> None:
    loader = MediaLoader(MediaConfig(max_video_fps=3.0))
    strict = InputProcessor.from_pretrained(qwen2_vl_dir, media_loader=loader)
    assert strict.request_config({"fps": 3}).video.fps == 3
    with pytest.raises(InvalidRequestError, match=r"limit of 3 \(--max-video-fps\)") as info:
        strict.request_config(None, {"video": {"fps": 4}})
    assert info.value.param == "media_io_kwargs.video.fps"
    with pytest.raises(ValueError, match="--max-video-fps"):
        MediaConfig(max_video_fps=0)


@pytest.mark.parametrize(
    ("mm", "io", "param"),
    [
        (None, {"video": {"fps": -1}}, "media_io_kwargs.video.fps"),
        (None, {"video": {"fps": "4"}}, "media_io_kwargs.video.fps"),
        (None, {"video": {"num_frames": 0}}, "media_io_kwargs.video.num_frames"),
        (None, {"video": {"num_frames": -1}}, "media_io_kwargs.video.num_frames"),
        (None, {"video": {"num_frames": 2.5}}, "media_io_kwargs.video.num_frames"),
        (None, {"video": {"fps": 1e9}}, "media_io_kwargs.video.fps"),
        (None, {"video": {"fps": 2, "num_frames": 8}}, "media_io_kwargs.video.num_frames"),
        (None, {"video": {"frames_indices": [0, 1]}}, "media_io_kwargs.video.frames_indices"),
        (None, {"image": {"image_mode": "RGBA"}}, "media_io_kwargs.image"),
        (None, {"video": 4}, "media_io_kwargs.video"),
        (None, [4], "media_io_kwargs"),
        ({"fps": 2}, {"video": {"fps": 4}}, "media_io_kwargs.video.fps"),
        ({"size": {"longest_edge": -1}}, None, "mm_processor_kwargs.size.longest_edge"),
        ({"size": {"height": 4}}, None, "mm_processor_kwargs.size"),
        ({"size": {"longest_edge": 4000}, "max_pixels": 5000}, None,
         "mm_processor_kwargs.size.longest_edge"),
    ],
)  # fmt: skip
def test_bad_request_kwargs_are_refused_naming_the_field(
    processor: InputProcessor, mm, io, param
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        processor.request_config(mm, io)
    assert info.value.param == param and param in info.value.message


def test_size_is_transformers_spelling_of_min_and_max_pixels(processor: InputProcessor) -> None:
    size = {"size": {"shortest_edge": 3136, "longest_edge": 12544}}
    assert split_processor_kwargs(size) == split_processor_kwargs(
        {"min_pixels": 3136, "max_pixels": 12544}
    )
    cfg = processor.request_config(size)
    assert (cfg.image.min_pixels, cfg.image.max_pixels) == (3136, 12544)
    assert (cfg.video.min_pixels, cfg.video.max_pixels) == (3136, 12544)
    assert video_request_kwargs({"fps": 4}, {"video": {"fps": 4}}) == (
        {"fps": 4},
        {"fps": "media_io_kwargs.video.fps"},
    )


def test_server_wide_kwargs_meet_the_fps_flag(qwen2_vl_dir: Path) -> None:
    def build(kwargs: dict, max_fps: float) -> InputProcessor:
        loader = MediaLoader(MediaConfig(max_video_fps=max_fps))
        return InputProcessor.from_pretrained(
            qwen2_vl_dir, mm_processor_kwargs=kwargs, media_loader=loader
        )

    slow = build({"fps": 1}, 1.0)  # the server's own rate lowered to fit a low ceiling
    assert (slow.video_config.fps, slow.video_config.max_fps) == (1.0, 1.0)
    with pytest.raises(ValueError, match="raise --max-video-fps"):
        build({"fps": 4}, 2.0)
    with pytest.raises(ValueError, match="num_frames is a request's choice"):
        build({"num_frames": 8}, 30.0)
    sized = build({"size": {"longest_edge": 3136}}, 30.0)
    assert sized.video_config.max_pixels == sized.image_config.max_pixels == 3136
