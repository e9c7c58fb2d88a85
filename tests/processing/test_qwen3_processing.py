"""Qwen3-VL processing against transformers' Qwen3VLProcessor and get_rope_index: prompt ids,
patches, grids and M-RoPE positions for images (limits from `size`, per-request overrides)
and videos (one timestamped group per temporal patch, frames given or decoded from a file)."""

from __future__ import annotations

import io
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

from mmserve.config.media import MediaConfig
from mmserve.errors import InvalidRequestError
from mmserve.processing.decode_workers import DecodeWorkerPool
from mmserve.processing.input_processor import InputProcessor
from mmserve.processing.modalities import ProcessingConfig, VideoModality
from mmserve.processing.video_decode import decode_video_bytes
from mmserve.processing.video_processor import VideoMeta
from mmserve.processing.video_worker import decode_video_in_worker
from tests.support.factory import random_image, video_bytes, video_frames
from tests.support.qwen3_processing import (
    VIDEO_MAX_PIXELS,
    hf_qwen3_processor,
    hf_rope_index,
    write_qwen3_processor_dir,
)

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_processor_dir(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def processor(qwen3_dir: Path) -> InputProcessor:
    return InputProcessor.from_pretrained(qwen3_dir, max_model_len=8192)


def _hf(qwen3_dir: Path, prompt: str, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf_qwen3_processor(qwen3_dir)(text=[prompt], return_tensors="np", **kwargs)


def _check_images(ours, ref, qwen3_dir: Path) -> None:
    assert ours.prompt_token_ids == ref["input_ids"][0].tolist()
    grids = [f.grid_thw for f in ours.mm_features]
    assert grids == [tuple(int(v) for v in g) for g in ref["image_grid_thw"]]
    pixels = np.concatenate([ours.mm_data[f.identifier].normalized() for f in ours.mm_features])
    assert pixels.shape[1] == 3 * 2 * 16 * 16  # a patch row: C * T * P * P
    np.testing.assert_array_equal(pixels, ref["pixel_values"])  # levels normalised: bit for bit
    positions, delta = hf_rope_index(qwen3_dir, ours.prompt_token_ids, grids, [])
    np.testing.assert_array_equal(ours.mrope_positions, positions)
    assert ours.mrope_position_delta == delta


@pytest.mark.parametrize(
    "sizes",
    [
        [(120, 90)],  # one image
        [(200, 150), (64, 300)],  # two of different sizes
        [(40, 900)],  # tall and thin: the area cap scales it down, sides stay >= 32
        [(20, 20)],  # under min_pixels: scaled up
    ],
)
def test_images_match_transformers(processor, qwen3_dir, sizes) -> None:
    images = [random_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    prompt = IMAGE * len(images) + "Describe."
    ours = processor.process(prompt, images)
    _check_images(ours, _hf(qwen3_dir, prompt, images=images), qwen3_dir)


def test_image_limits_come_from_the_size_dict(processor) -> None:
    cfg = processor.image_config
    assert (cfg.patch_size, cfg.factor) == (16, 32)
    assert cfg.image_mean == cfg.image_std == (0.5, 0.5, 0.5)
    assert (cfg.min_pixels, cfg.max_pixels) == (8 * 32 * 32, 64 * 32 * 32)


@pytest.mark.parametrize(
    ("ours_kwargs", "hf_kwargs"),
    [
        ({"size": {"shortest_edge": 1024, "longest_edge": 16 * 1024}},) * 2,
        (
            {"min_pixels": 1024, "max_pixels": 12 * 1024},
            {"size": {"shortest_edge": 1024, "longest_edge": 12 * 1024}},
        ),
    ],
)
def test_per_request_size_and_pixel_overrides(processor, qwen3_dir, ours_kwargs, hf_kwargs):
    images = [random_image(300, 200, seed=3), random_image(50, 400, seed=4)]
    prompt = IMAGE + "and" + IMAGE
    ours = processor.process(prompt, images, mm_processor_kwargs=ours_kwargs)
    default = processor.process(prompt, images)
    assert ours.mm_features[0].grid_thw != default.mm_features[0].grid_thw
    _check_images(ours, _hf(qwen3_dir, prompt, images=images, **hf_kwargs), qwen3_dir)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"size": {"longest": 5}},
        {"size": {"longest_edge": 0}},
        {"size": {"longest_edge": "big"}},
        {"size": [1, 2]},
        {"size": {}},
        {"size": {"longest_edge": 20480}, "max_pixels": 40960},  # two different caps
    ],
)
def test_a_bad_size_is_refused_naming_the_field(processor, kwargs) -> None:
    with pytest.raises(InvalidRequestError) as e:
        processor.process(IMAGE, [random_image(40, 40)], mm_processor_kwargs=kwargs)
    assert (e.value.param or "").startswith("mm_processor_kwargs.size")


def _check_video(ours, ref, qwen3_dir: Path, pad: int, image_grids=()) -> None:
    assert ours.prompt_token_ids == ref["input_ids"][0].tolist()
    (t, h, w) = (int(v) for v in ref["video_grid_thw"][0])
    groups = [f for f in ours.mm_features if f.modality == "video"]
    assert [f.grid_thw for f in groups] == [(1, h, w)] * t  # one item per temporal patch
    pixels = np.concatenate([ours.mm_data[f.identifier].normalized() for f in groups])
    np.testing.assert_array_equal(pixels, ref["pixel_values_videos"])
    ids = np.asarray(ours.prompt_token_ids)
    for f in groups:  # each range is exactly its group's placeholders
        span = ids[f.placeholder.offset : f.placeholder.end]
        assert f.placeholder.length == h * w // 4 and (span == pad).all()
        assert ids[f.placeholder.offset - 1] != pad and ids[f.placeholder.end] != pad
    assert (ids == pad).sum() == sum(f.placeholder.length for f in groups)
    assert len({f.identifier for f in groups}) == t
    positions, delta = hf_rope_index(
        qwen3_dir, ours.prompt_token_ids, list(image_grids), ref["video_grid_thw"].tolist()
    )
    np.testing.assert_array_equal(ours.mrope_positions, positions)
    assert ours.mrope_position_delta == delta


@pytest.mark.parametrize(("num_frames", "width", "height"), [(5, 80, 64), (8, 200, 120)])
def test_video_frames_match_transformers(processor, qwen3_dir, num_frames, width, height):
    """Given frames count as sampled at 2 per second: frame i at i / 2 seconds."""
    from transformers.video_utils import VideoMetadata

    frames = video_frames(num_frames, width, height, seed=num_frames)
    prompt = VIDEO + "What happens?"
    ours = processor.process_generate_input(
        {"prompt": prompt, "multi_modal_data": {"video": frames}}
    )
    meta = VideoMetadata(total_num_frames=num_frames, fps=2, frames_indices=list(range(num_frames)))
    ref = _hf(qwen3_dir, prompt, videos=[frames], video_metadata=[meta], do_sample_frames=False)
    _check_video(ours, ref, qwen3_dir, processor.token_ids.video_token_id)
    text = processor.tokenizer.decode(ours.prompt_token_ids, skip_special_tokens=False)
    assert text.startswith("<|vision_start|><0.2 seconds><|vision_start|><|video_pad|>")


def test_video_and_image_chat_match_transformers(processor, qwen3_dir) -> None:
    from transformers.video_utils import VideoMetadata

    frames = video_frames(4, 96, 64, seed=2)
    image = random_image(70, 50, seed=3)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video", "video": frames},
                {"type": "image", "image": image},
                {"type": "text", "text": "Compare."},
            ],
        }
    ]
    ours = processor.process_chat(messages)
    prompt = processor.render_chat_parts(messages)[0]
    meta = VideoMetadata(total_num_frames=4, fps=2, frames_indices=[0, 1, 2, 3])
    ref = _hf(
        qwen3_dir,
        prompt,
        images=[image],
        videos=[frames],
        video_metadata=[meta],
        do_sample_frames=False,
    )
    image_grids = [f.grid_thw for f in ours.mm_features if f.modality == "image"]
    assert image_grids == [tuple(int(v) for v in ref["image_grid_thw"][0])]
    _check_video(ours, ref, qwen3_dir, processor.token_ids.video_token_id, image_grids)


@pytest.mark.parametrize(("num_frames", "fps", "kwargs"), [(30, 10, {}), (21, 6, {"fps": 1.0})])
def test_video_file_matches_transformers_sampling_and_times(
    processor, qwen3_dir, num_frames, fps, kwargs
) -> None:
    """A decoded file: transformers samples from all its frames with their real times."""
    import av
    from transformers.video_utils import VideoMetadata

    data = video_bytes(num_frames, 96, 64, fps=fps, seed=5)
    with av.open(io.BytesIO(data)) as container:
        every = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert len(every) == num_frames
    prompt = VIDEO + "What happens?"
    ours = processor.process_generate_input(
        {"prompt": prompt, "multi_modal_data": {"video": data}, "mm_processor_kwargs": kwargs}
    )
    meta = VideoMetadata(total_num_frames=num_frames, fps=fps)
    ref = _hf(qwen3_dir, prompt, videos=[every], video_metadata=[meta], **kwargs)
    _check_video(ours, ref, qwen3_dir, processor.token_ids.video_token_id)


def test_the_budget_is_over_all_frames(processor) -> None:
    """size.longest_edge bounds t_bar x h x w: more frames, smaller frames."""
    cfg = processor.request_config(None)
    assert cfg.video.timestamps and cfg.video.total_pixels == VIDEO_MAX_PIXELS
    sizes = []
    for n in (2, 8, 24):
        plan = VideoModality().plan(VideoMeta(640, 480, n, 2.0, is_sampled=True), cfg)
        t, h, w = plan.grid_thw
        assert 2 * t * h * w * 16 * 16 <= VIDEO_MAX_PIXELS
        sizes.append(h * w)
    assert sizes[0] > sizes[1] > sizes[2]


def test_frame_times_are_part_of_a_videos_identity(processor) -> None:
    cfg: ProcessingConfig = processor.request_config(None)
    video = VideoModality()
    base = VideoMeta(64, 48, 40, 10.0, frame_times=((0, 0.0), (6, 0.6)))
    later = VideoMeta(64, 48, 40, 10.0, frame_times=((0, 0.0), (6, 1.2)))
    assert video.plan(base, cfg).decision != video.plan(later, cfg).decision


def test_the_largest_item_bound_covers_every_group(processor) -> None:
    cfg = processor.request_config(None)
    worst = 0
    for n in range(2, 40):
        for w, h in ((640, 480), (32, 4000), (5000, 32), (17, 17), (3000, 3000)):
            plan = VideoModality().plan(VideoMeta(w, h, n, 2.0, is_sampled=True), cfg)
            worst = max(worst, plan.num_tokens // plan.grid_thw[0])  # one group's tokens
    assert worst <= processor.max_tokens_per_mm_item


def test_a_decoded_file_carries_its_real_frame_times(processor) -> None:
    """Frames one second apart in a container whose header claims 16/15 fps: the prompt's
    times are the frames' presentation times, in process and from a decode worker alike."""
    data = video_bytes(12, 64, 48, fps=4, seconds_per_frame=1)
    cfg = processor.request_config(None)
    limits = MediaConfig().video_limits
    in_process = decode_video_bytes(data, cfg.video, cfg.image, limits)
    pool = DecodeWorkerPool(1, timeout_s=60.0, max_rss_bytes=0)
    try:
        in_worker = decode_video_in_worker(pool, data, cfg.video, cfg.image, limits)
    finally:
        pool.close()
    expected = tuple((i, float(i)) for i in range(12))
    assert in_process.meta.frame_times == in_worker.meta.frame_times == expected
    ours = processor.process_generate_input({"prompt": VIDEO, "multi_modal_data": {"video": data}})
    text = processor.tokenizer.decode(ours.prompt_token_ids, skip_special_tokens=False)
    times = [float(t) for t in re.findall(r"<([0-9.]+) seconds>", text)]
    assert times == [0.5, 2.5, 4.5, 6.5, 8.5, 10.5]  # index / header fps would say 0.5, 2.3, ...


def test_a_request_size_sets_the_video_budget_too(processor, qwen3_dir) -> None:
    """As in transformers, a per-call `size` reaches both processors; for a Qwen3-VL video it
    is the clip's floor and budget (a request may only lower the server's)."""
    from transformers.video_utils import VideoMetadata

    frames = video_frames(6, 160, 120, seed=7)
    image = random_image(150, 100, seed=8)
    size = {"shortest_edge": 4 * 1024, "longest_edge": 40 * 1024}
    prompt = VIDEO + IMAGE + "Compare."
    ours = processor.process_generate_input(
        {
            "prompt": prompt,
            "multi_modal_data": {"video": frames, "image": image},
            "mm_processor_kwargs": {"size": size},
        }
    )
    default = processor.process_generate_input(
        {"prompt": prompt, "multi_modal_data": {"video": frames, "image": image}}
    )
    assert ours.mm_features[0].grid_thw != default.mm_features[0].grid_thw
    meta = VideoMetadata(total_num_frames=6, fps=2, frames_indices=list(range(6)))
    ref = _hf(
        qwen3_dir,
        prompt,
        images=[image],
        videos=[frames],
        video_metadata=[meta],
        do_sample_frames=False,
        size=size,
    )
    image_grids = [f.grid_thw for f in ours.mm_features if f.modality == "image"]
    _check_video(ours, ref, qwen3_dir, processor.token_ids.video_token_id, image_grids)


def test_per_request_sampling_reaches_the_timestamps(processor, qwen3_dir) -> None:
    """Frames given at a request's fps are timed at that rate; a file sampled by num_frames
    keeps that many frames (as transformers' sample_frames, no rounding to pairs)."""
    from transformers.video_utils import VideoMetadata

    frames = video_frames(6, 96, 64, seed=9)
    prompt = VIDEO + "What happens?"
    ours = processor.process_generate_input(
        {
            "prompt": prompt,
            "multi_modal_data": {"video": frames},
            "mm_processor_kwargs": {"fps": 4.0},
        }
    )
    meta = VideoMetadata(total_num_frames=6, fps=4, frames_indices=list(range(6)))
    ref = _hf(qwen3_dir, prompt, videos=[frames], video_metadata=[meta], do_sample_frames=False)
    _check_video(ours, ref, qwen3_dir, processor.token_ids.video_token_id)

    import av

    data = video_bytes(24, 96, 64, fps=8, seed=10)
    with av.open(io.BytesIO(data)) as container:
        every = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    ours = processor.process_generate_input(
        {
            "prompt": prompt,
            "multi_modal_data": {"video": data},
            "mm_processor_kwargs": {"num_frames": 5},
        }
    )
    meta = VideoMetadata(total_num_frames=24, fps=8)
    ref = _hf(qwen3_dir, prompt, videos=[every], video_metadata=[meta], num_frames=5, fps=None)
    _check_video(ours, ref, qwen3_dir, processor.token_ids.video_token_id)
    assert len([f for f in ours.mm_features if f.modality == "video"]) == 3  # 5 frames, padded
