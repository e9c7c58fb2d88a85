"""The encoder's device stage with DeepStack rows: what it sends and what its embedding cache
counts are whole rows, hidden x (1 + levels) wide; a tower of another width is a loud error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.disaggregation.embedding_cache import ByteBudgetLRU, CachedEmbedding
from mmserve.disaggregation.vision_stage import VisionStage
from mmserve.models.loader import load_vision_tower
from mmserve.processing.image_processor import ImageProcessorConfig, process_image
from tests.support.deepstack import DeepStackTower, with_deepstack_levels
from tests.support.factory import random_image

LEVELS = 2  # the tiny Qwen2-VL tower has 2 blocks to tap


@pytest.fixture(scope="module")
def tower(qwen2_vl_dir):
    tower, config = load_vision_tower(qwen2_vl_dir, dtype=torch.float32)
    return tower, config


def _image(model_dir, width: int, height: int, seed: int):
    return process_image(
        random_image(width, height, seed), ImageProcessorConfig.from_pretrained(model_dir)
    )


def test_deepstack_rows_are_sent_whole_and_the_cache_counts_every_level(qwen2_vl_dir, tower):
    plain_tower, config = tower
    deep_config = with_deepstack_levels(config, LEVELS)
    width = deep_config.mm_embedding_width
    assert width == config.hidden_size * (1 + LEVELS)
    plain = VisionStage(
        plain_tower, torch.device("cpu"), torch.float32, embedding_width=config.mm_embedding_width
    )
    deep = VisionStage(
        DeepStackTower(plain_tower, LEVELS),
        torch.device("cpu"),
        torch.float32,
        embedding_width=width,
    )
    images = [_image(qwen2_vl_dir, 56, 84, 1), _image(qwen2_vl_dir, 112, 56, 2)]
    main_rows = plain.encode(images)
    rows = deep.encode(images)
    cache: ByteBudgetLRU[CachedEmbedding] = ByteBudgetLRU(1 << 20)
    for image, main, out in zip(images, main_rows, rows, strict=True):
        num_tokens = image.num_patches // 4
        assert out.shape == (num_tokens, width) and out.grid_thw == tuple(image.grid_thw)
        assert out.nbytes == num_tokens * config.hidden_size * (1 + LEVELS) * 4  # float32
        got = np.frombuffer(out.data, dtype=np.float32).reshape(out.shape)
        want = np.frombuffer(main.data, dtype=np.float32).reshape(main.shape)
        hidden = config.hidden_size
        for level in range(1 + LEVELS):  # the main embedding, then each level, in order
            scale = 1 if level == 0 else level + 1
            np.testing.assert_allclose(got[:, level * hidden : (level + 1) * hidden], want * scale)
        assert cache.put(f"item-{num_tokens}", out, out.nbytes)
    assert cache.num_bytes == sum(i.num_patches // 4 for i in images) * width * 4


def test_a_tower_of_another_width_is_refused_not_sent(qwen2_vl_dir, tower):
    plain_tower, config = tower
    width = with_deepstack_levels(config, LEVELS).mm_embedding_width
    stage = VisionStage(plain_tower, torch.device("cpu"), torch.float32, embedding_width=width)
    with pytest.raises(RuntimeError, match=f"rows of width {config.hidden_size}, the model's"):
        stage.encode([_image(qwen2_vl_dir, 56, 56, 3)])
