"""M-RoPE positions against transformers' get_rope_index (images, videos, Qwen2.5-VL time)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mmserve.errors import InvalidRequestError
from mmserve.models.config import ModelConfig, load_model_config
from mmserve.processing.mrope import decode_positions, get_mrope_positions

IMAGE, VIDEO = "image", "video"


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint: Path) -> tuple[ModelConfig, torch.nn.Module]:
    import transformers

    config = load_model_config(tiny_checkpoint)
    hf = getattr(transformers, config.architecture).from_pretrained(tiny_checkpoint)
    return config, hf.model


def _prompt(config: ModelConfig, parts: list) -> tuple[list[int], list[int]]:
    """Token ids and mm_token_type_ids for text lengths (int) and (kind, grid) items."""
    ids, types = [], []
    for part in parts:
        if isinstance(part, int):
            ids += [(7 * i + 3) % 300 for i in range(part)]
            types += [0] * part
            continue
        kind, (t, h, w) = part
        n = t * h * w // config.vision.spatial_merge_size**2
        token = config.image_token_id if kind == IMAGE else config.video_token_id
        ids += [config.vision_start_token_id] + [token] * n + [config.vision_end_token_id]
        types += [0] + [1 if kind == IMAGE else 2] * n + [0]
    return ids, types


def _both(config, hf_model, parts, second_per_grid_ts=()):
    ids, types = _prompt(config, parts)
    images = [g for p in parts if not isinstance(p, int) and p[0] == IMAGE for g in [p[1]]]
    videos = [g for p in parts if not isinstance(p, int) and p[0] == VIDEO for g in [p[1]]]
    ours = get_mrope_positions(
        ids,
        images,
        image_token_id=config.image_token_id,
        video_token_id=config.video_token_id,
        spatial_merge_size=config.vision.spatial_merge_size,
        video_grid_thw=videos,
        second_per_grid_ts=second_per_grid_ts,
        tokens_per_second=config.vision.tokens_per_second,
    )
    kwargs = {
        "image_grid_thw": torch.tensor(images) if images else None,
        "video_grid_thw": torch.tensor(videos) if videos else None,
    }
    if second_per_grid_ts:
        kwargs["second_per_grid_ts"] = torch.tensor(second_per_grid_ts)
    ref, ref_delta = hf_model.get_rope_index(
        torch.tensor([ids]), mm_token_type_ids=torch.tensor([types]), **kwargs
    )
    return ours, ref[:, 0].numpy(), int(ref_delta[0, 0])


@pytest.mark.parametrize(
    "parts",
    [
        [5, (IMAGE, (1, 4, 8)), 9, (IMAGE, (1, 10, 14)), 3],
        [(IMAGE, (1, 6, 4)), (IMAGE, (1, 2, 8)), 1],  # back-to-back items, no text between
        [4, (VIDEO, (3, 8, 12)), 6, (IMAGE, (1, 4, 4)), 2],
    ],
)
def test_positions_match_transformers(oracle, parts) -> None:
    config, hf_model = oracle
    (positions, delta), ref, ref_delta = _both(config, hf_model, parts)
    assert positions.dtype == np.int64 and positions.shape == ref.shape
    np.testing.assert_array_equal(positions, ref)
    assert delta == ref_delta and delta < 0  # every case here compresses positions


def test_qwen2_5_video_time_spacing_matches_transformers(qwen2_5_vl_dir: Path) -> None:
    import transformers

    config = load_model_config(qwen2_5_vl_dir)
    hf_model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen2_5_vl_dir).model
    # tokens_per_second=2: intervals 1.4 (truncated to 0, 1, 2) and 2.0
    parts = [3, (VIDEO, (3, 4, 12)), 2, (VIDEO, (3, 8, 12)), 4, (IMAGE, (1, 4, 6)), 1]
    (positions, delta), ref, ref_delta = _both(config, hf_model, parts, [0.7, 1.0])
    np.testing.assert_array_equal(positions, ref)
    assert delta == ref_delta
    first_video = positions[0, 4 : 4 + 3 * 2 * 6]
    assert sorted(set(first_video.tolist())) == [4, 5, 6]


def test_text_after_a_long_video_starts_past_every_position() -> None:
    """Where the temporal span exceeds the spatial one we follow the original Qwen code (and
    vLLM): text resumes after the largest position on any axis (transformers 5.23 does not)."""
    ids = [1, 2] + [9] * (8 * 2 * 2) + [3, 4]
    positions, delta = get_mrope_positions(
        ids,
        (),
        image_token_id=8,
        video_token_id=9,
        spatial_merge_size=2,
        video_grid_thw=[(8, 4, 4)],
        second_per_grid_ts=[1.0],
        tokens_per_second=2,
    )
    video_max = positions[:, 2:-2].max()
    assert video_max == 2 + 7 * 2  # last frame's temporal position
    np.testing.assert_array_equal(
        positions[:, -2:], np.tile([video_max + 1, video_max + 2], (3, 1))
    )
    assert delta == video_max + 3 - len(ids)


def test_decode_positions_continue_the_prompt() -> None:
    ids = [1] + [8] * 4 + [2]
    positions, delta = get_mrope_positions(
        ids, [(1, 4, 4)], image_token_id=8, video_token_id=9, spatial_merge_size=2
    )
    assert positions[:, -1].tolist() == [3, 3, 3] and delta == -2
    np.testing.assert_array_equal(decode_positions(6, 2, delta), np.tile([4, 5], (3, 1)))


def test_placeholder_and_grid_mismatches_are_user_errors() -> None:
    kwargs = {"image_token_id": 8, "video_token_id": 9, "spatial_merge_size": 2}
    with pytest.raises(InvalidRequestError, match="needs 4 consecutive placeholder"):
        get_mrope_positions([1, 8, 8, 8, 2], [(1, 4, 4)], **kwargs)
    with pytest.raises(InvalidRequestError, match="more image placeholders"):
        get_mrope_positions([1, 8, 8, 8, 8, 8], [(1, 4, 4)], **kwargs)
    with pytest.raises(InvalidRequestError, match="2 image grids given"):
        get_mrope_positions([1, 8, 8, 8, 8], [(1, 4, 4), (1, 2, 2)], **kwargs)


def test_module_does_not_import_torch() -> None:
    code = "import sys, mmserve.processing.mrope; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
