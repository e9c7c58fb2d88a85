"""Videos through the InputProcessor: ids, patches and M-RoPE against transformers, identity,
caches, limits, and every offline form a video may take."""

from __future__ import annotations

import asyncio
import base64
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from mmserve.errors import InvalidRequestError, TooManyItemsError, UnknownMediaUUIDError
from mmserve.models.config import load_model_config
from mmserve.processing.input_processor import InputProcessor
from tests.support.factory import random_image, video_bytes, video_frames

VIDEO_PROMPT = "<|vision_start|><|video_pad|><|vision_end|>What happens?"
SMALL = {"min_pixels": 3136, "max_pixels": 12544}  # 4..16 tokens per temporal patch


@pytest.fixture
def processor(tiny_checkpoint: Path) -> InputProcessor:
    return InputProcessor.from_pretrained(
        tiny_checkpoint, max_model_len=4096, mm_processor_cache_gb=0.05
    )


def _hf_processor(model_dir: Path):
    from transformers import AutoTokenizer, Qwen2VLProcessor, Qwen2VLVideoProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(model_dir),
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        video_processor=Qwen2VLVideoProcessor(),  # qwen-vl-utils' sizes, as ours by default
    )


def _chat(video: object, image: object = None) -> list[dict]:
    parts: list[dict] = [{"type": "video", "video": video}]
    if image is not None:
        parts.append({"type": "image", "image": image})
    parts.append({"type": "text", "text": "What happens?"})
    return [{"role": "user", "content": parts}]


def test_video_and_image_chat_matches_transformers_processor(
    processor: InputProcessor, tiny_checkpoint: Path
) -> None:
    frames = video_frames(5, 40, 32, seed=4)  # odd: the processor repeats the last frame
    image = random_image(60, 44, seed=5)
    ours = processor.process_chat(_chat(frames, image))
    prompt = processor.render_chat_parts(_chat(frames, image))[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = _hf_processor(tiny_checkpoint)(
            text=[prompt],
            images=[image],
            videos=[frames],
            do_sample_frames=False,
            cap_pixels_per_frame=True,
            return_tensors="np",
        )
    assert ours.prompt_token_ids == ref["input_ids"][0].tolist()
    video, img = ours.mm_features
    assert (video.modality, img.modality) == ("video", "image")
    assert video.grid_thw == tuple(ref["video_grid_thw"][0])
    t, h, w = video.grid_thw
    assert t == 3  # 5 frames + 1 repeated, two per temporal patch
    video_data = ours.mm_data[video.identifier]
    np.testing.assert_array_equal(video_data.normalized(), ref["pixel_values_videos"])
    assert video_data.second_per_grid_t == 1.0  # frames count as sampled at 2 fps
    ids = np.asarray(ours.prompt_token_ids)
    pad = processor.token_ids.video_token_id
    span = ids[video.placeholder.offset : video.placeholder.end]
    assert video.placeholder.length == t * h * w // 4 and (span == pad).all()
    assert (ids == pad).sum() == video.placeholder.length


def test_mrope_matches_get_rope_index_for_video_and_image(
    processor: InputProcessor, tiny_checkpoint: Path
) -> None:
    import transformers

    config = load_model_config(tiny_checkpoint)
    hf = getattr(transformers, config.architecture).from_pretrained(tiny_checkpoint).model
    data = video_bytes(30, 128, 96, fps=10, seed=1)  # 3 s
    # fps 1.3 -> 4 frames, 1.5 s per temporal patch: Qwen2.5-VL spaces them 3 positions
    # apart. Frames 84x140 (3x5 merged): the spatial span exceeds the temporal one, where
    # transformers 5 and the original Qwen code agree on where the text resumes (mrope.py).
    kwargs = {"min_pixels": 3136, "max_pixels": 28224, "fps": 1.3}
    prompt = processor.process_chat(
        _chat(data, random_image(50, 40, seed=2)), mm_processor_kwargs=kwargs
    )
    video, image = prompt.mm_features
    assert prompt.mm_data[video.identifier].second_per_grid_t == pytest.approx(1.5)
    ids = torch.tensor([prompt.prompt_token_ids])
    types = (ids == config.image_token_id).long() + 2 * (ids == config.video_token_id).long()
    kwargs = {
        "image_grid_thw": torch.tensor([image.grid_thw]),
        "video_grid_thw": torch.tensor([video.grid_thw]),
    }
    if config.architecture.startswith("Qwen2_5"):
        seconds = prompt.mm_data[video.identifier].second_per_grid_t
        kwargs["second_per_grid_ts"] = torch.tensor([seconds])
    ref, delta = hf.get_rope_index(ids, mm_token_type_ids=types, **kwargs)
    np.testing.assert_array_equal(prompt.mrope_positions, ref[:, 0].numpy())
    assert prompt.mrope_position_delta == int(delta[0, 0])


def test_a_video_identity_covers_its_bytes_and_its_sampling(processor: InputProcessor) -> None:
    data = video_bytes(40, 64, 48, fps=10, seed=1)

    def ident(video: object, **kwargs: object) -> str:
        prompt = {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video}}
        kw = {**SMALL, **kwargs}
        return (
            processor.process_generate_input({**prompt, "mm_processor_kwargs": kw})
            .mm_features[0]
            .identifier
        )

    base = ident(data)
    queries, hits = processor.cache.stats.queries, processor.cache.stats.hits
    assert ident(data) == base  # same bytes, same arguments
    assert processor.cache.stats.hits == hits + 1 and processor.cache.stats.queries == queries + 1
    others = {
        ident(video_bytes(40, 64, 48, fps=10, seed=2)),  # another video
        ident(data, fps=1.0),  # other frames kept: 4 of the 4 s clip's 40
        ident(data, max_frames=6),
        ident(data, max_pixels=1000, min_pixels=784),  # other frame size (28x28)
    }
    assert base not in others and len(others) == 4
    assert ident(data, max_pixels=3136) == base  # a cap that changes nothing changes no id
    assert ident(data, max_frames=4) == ident(data, fps=1.0)  # the same 4 frames: one id
    frames = video_frames(4, 32, 32)
    assert ident(frames) == ident(frames.copy()) != ident(frames[::-1].copy())


def test_uuid_references_work_for_videos(processor: InputProcessor) -> None:
    url = "data:video/mp4;base64," + base64.b64encode(video_bytes(20, 64, 48, fps=10)).decode()

    def chat(video_url: dict) -> list[dict]:
        parts = [{"type": "video_url", "video_url": video_url}, {"type": "text", "text": "hi"}]
        return [{"role": "user", "content": parts}]

    first = asyncio.run(
        processor.aprocess_chat(chat({"url": url, "uuid": "clip-1"}), mm_processor_kwargs=SMALL)
    )
    again = asyncio.run(
        processor.aprocess_chat(chat({"uuid": "clip-1"}), mm_processor_kwargs=SMALL)
    )
    assert again.mm_features[0].identifier == first.mm_features[0].identifier
    assert again.prompt_token_ids == first.prompt_token_ids
    with pytest.raises(UnknownMediaUUIDError, match="video uuid 'clip-1'"):
        # another fps samples other frames: only the video itself can give them
        asyncio.run(
            processor.aprocess_chat(
                chat({"uuid": "clip-1"}), mm_processor_kwargs={**SMALL, "fps": 4.0}
            )
        )
    # fps 1 keeps the same 4 frames of this 2 s clip as the default 2 (min_frames): a hit
    slower = asyncio.run(
        processor.aprocess_chat(chat({"uuid": "clip-1"}), mm_processor_kwargs={**SMALL, "fps": 1})
    )
    assert slower.mm_features[0].identifier == first.mm_features[0].identifier


def test_offline_forms_of_a_video_agree(processor: InputProcessor, tmp_path: Path) -> None:
    data = video_bytes(20, 64, 48, fps=10)
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)

    def generate(video: object) -> list[int]:
        prompt = {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video}}
        return processor.process_generate_input({**prompt, "mm_processor_kwargs": SMALL})

    from_path, from_bytes = generate(str(path)), generate(data)
    assert from_path.mm_features[0].identifier == from_bytes.mm_features[0].identifier
    assert from_path.prompt_token_ids == generate(path).prompt_token_ids
    frames = video_frames(4, 32, 32)
    as_list = generate([f for f in frames])
    assert as_list.mm_features[0].identifier == generate(frames).mm_features[0].identifier
    from PIL import Image

    pil = generate([Image.fromarray(f) for f in frames])
    assert pil.mm_features[0].identifier == as_list.mm_features[0].identifier
    for bad, why in [
        (frames.astype(np.float32), "uint8"),
        (frames[..., :2], "uint8 array"),
        (np.zeros((800, 8, 8, 3), np.uint8), "over the limit of 768"),
        ([frames[0], "x"], "must be a uint8 array or a PIL image"),
        (str(tmp_path / "missing.mp4"), "could not be read"),
    ]:
        with pytest.raises(InvalidRequestError, match=why):
            generate(bad)


def test_video_limits_and_kwargs_are_refused_before_any_decode(tiny_checkpoint: Path) -> None:
    default = InputProcessor.from_pretrained(tiny_checkpoint)
    two = "<|vision_start|><|video_pad|><|vision_end|>" * 2
    videos = [video_frames(2, 16, 16)] * 2
    with pytest.raises(TooManyItemsError, match='"video": 1'):
        default.process_generate_input({"prompt": two, "multi_modal_data": {"video": videos}})
    none = InputProcessor.from_pretrained(tiny_checkpoint, limit_mm_per_prompt={"video": 0})
    with pytest.raises(TooManyItemsError, match='"video": 0'):
        none.process_chat(_chat(video_frames(2, 16, 16)))
    with pytest.raises(InvalidRequestError, match="max_frames is 1000") as info:
        default.process_chat(
            _chat("data:video/mp4;base64,AAAA"), mm_processor_kwargs={"max_frames": 1000}
        )
    assert info.value.param == "mm_processor_kwargs.max_frames"


def test_server_wide_video_settings(tiny_checkpoint: Path) -> None:
    proc = InputProcessor.from_pretrained(
        tiny_checkpoint,
        max_model_len=8192,
        mm_processor_kwargs={"max_frames": 16, "fps": 1.0, "max_pixels": 3136},  # tiny images
    )
    assert (proc.video_config.max_frames, proc.video_config.fps) == (16, 1.0)
    with pytest.raises(InvalidRequestError, match="over this server's limit of 16"):
        proc.request_config({"max_frames": 32})
    # the image cap also lowers the video frames' bounds (it never raises them)
    assert (proc.video_config.min_pixels, proc.video_config.max_pixels) == (3136, 3136)
    # so the largest video, 8 temporal patches, is far below 8 at the default cap of 768
    assert proc.max_tokens_per_mm_item < 8 * 768
    assert proc.max_patches_per_mm_item == proc.max_tokens_per_mm_item * 4
    generous = InputProcessor.from_pretrained(
        tiny_checkpoint, max_model_len=8192, mm_processor_kwargs={"max_pixels": 1 << 30}
    )
    assert generous.video_config.max_pixels == 768 * 28 * 28  # a larger image cap: unchanged
