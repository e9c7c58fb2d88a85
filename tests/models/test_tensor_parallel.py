"""A whole model on 2 and 4 gloo ranks equals the model on one: the vision tower (sharded or
whole), a prefill with images through the splice (DeepStack levels for Qwen3-VL), and a
decode step over the per-rank KV cache, for every architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmserve.grid import grid_num_tokens
from mmserve.layers.attention import TorchAttentionBackend
from mmserve.layers.parallel import SINGLE, TPGroup
from mmserve.models.kv_cache import allocate_kv_caches
from mmserve.models.loader import load_model
from tests.support.distributed import run_ranks
from tests.support.factory import write_tiny_checkpoint

ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
GRIDS = [(1, 8, 8), (2, 4, 6)]  # Qwen2.5-VL: 8x8 patches of 14 px are 2x2 windows of 56 px
BLOCK_SIZE = 4
# An odd vocabulary: the last rank's LM head rows end in padding.
VOCAB = 451


def _text(arch: str, num_heads: int) -> dict:
    """Text overrides: `num_heads` query heads over 2 KV heads."""
    text = {"vocab_size": VOCAB, "num_attention_heads": num_heads, "num_key_value_heads": 2}
    if arch != "qwen3_vl":  # head_dim = 64 / heads: the M-RoPE sections must fill half of it
        half = 64 // num_heads // 2
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        text["rope_parameters"] = {
            **rope,
            "mrope_section": [half - 2 * (half // 4)] + [half // 4] * 2,
        }
    return text


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Path]:
    """(arch, query heads) -> a tiny checkpoint: 4 heads (2 per rank on 2 ranks) and 8 heads
    (2 per rank on 4 ranks, each of the 2 KV heads replicated on 2 ranks)."""
    root = tmp_path_factory.mktemp("tp")
    return {
        (arch, heads): write_tiny_checkpoint(
            root / f"{arch}-{heads}", arch, seed=7, text=_text(arch, heads)
        )
        for arch in ARCHS
        for heads in (4, 8)
    }


def _step(group: TPGroup, model_dir: Path, shard_vision: bool) -> dict[str, torch.Tensor]:
    """This rank's vision embeddings, prefill logits (two sequences with an image each) and
    the logits of one decode step after it."""
    torch.manual_seed(0)
    model, config = load_model(model_dir, dtype=torch.float32, tp=group, shard_vision=shard_vision)
    merge = config.vision.spatial_merge_size
    num_patches = sum(t * h * w for t, h, w in GRIDS)
    pixels = torch.randn(num_patches, config.vision.patch_input_dim)
    backend = TorchAttentionBackend()
    kv = allocate_kv_caches(config, 32, BLOCK_SIZE, "cpu", torch.float32, group)
    with torch.inference_mode():
        mm = model.embed_multimodal(pixels, GRIDS)
        seqs = [
            [5, 17, 33] + [config.image_token_id] * grid_num_tokens(grid, merge) + [7, 99]
            for grid in GRIDS
        ]
        lens = [len(s) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s])
        tables = [list(range(16 * i, 16 * i + 16)) for i in range(len(seqs))]
        positions = torch.cat([torch.arange(n) for n in lens]).expand(3, -1)
        meta = backend.build_metadata(lens, lens, tables, BLOCK_SIZE)
        embeds = model.embed_input_ids(ids, torch.cat(mm))
        prefill = model.compute_logits(model(None, positions, meta, kv, inputs_embeds=embeds))
        last = torch.tensor(lens).cumsum(0) - 1
        next_ids = prefill[last].argmax(-1)  # [2]
        meta = backend.build_metadata([1, 1], [n + 1 for n in lens], tables, BLOCK_SIZE)
        decode = model.compute_logits(model(next_ids, torch.tensor(lens).expand(3, -1), meta, kv))
    return {"vision": torch.cat(mm), "prefill": prefill, "decode": decode}


def _all_cases(group: TPGroup, cases: list[tuple[Path, bool]]) -> list[dict[str, torch.Tensor]]:
    return [_step(group, model_dir, shard_vision) for model_dir, shard_vision in cases]


def _assert_same_as_one_rank(
    size: int, num_heads: int, shard_modes: tuple[bool, ...], checkpoints: dict
) -> None:
    cases = [(checkpoints[arch, num_heads], shard) for arch in ARCHS for shard in shard_modes]
    reference = [_step(SINGLE, model_dir, False) for model_dir, _ in cases]
    for rank, results in enumerate(run_ranks(_all_cases, size, cases)):
        for (model_dir, shard), ref, got in zip(cases, reference, results, strict=True):
            for name, value in got.items():
                where = f"rank {rank} of {size}, {model_dir.name}, shard_vision={shard}: {name}"
                assert value.shape == ref[name].shape, where
                torch.testing.assert_close(value, ref[name], rtol=1e-4, atol=1e-4, msg=where)


def test_two_ranks_equal_one_for_every_architecture(checkpoints: dict) -> None:
    _assert_same_as_one_rank(2, 4, (False, True), checkpoints)


def test_four_ranks_with_replicated_kv_heads_equal_one(checkpoints: dict) -> None:
    # the tower sharded four ways too (whole, it is the 2-rank test's: it does not depend on
    # the group's size)
    _assert_same_as_one_rank(4, 8, (True,), checkpoints)
