"""config.json parsing: flat hub format, nested transformers-5 format, real checkpoint configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmserve.models.config import load_model_config, parse_model_config
from mmserve.models.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block

# config.json of Qwen/Qwen2-VL-7B-Instruct as published (flat format, transformers 4.41).
QWEN2_VL_7B = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2_vl",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "embed_dim": 1280,
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_chans": 3,
        "hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
}


def _flatten(nested: dict) -> dict:
    """The nested config rewritten in the older flat hub format."""
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    text = dict(nested["text_config"])
    rope = text.pop("rope_parameters")
    flat.update(text)
    flat["rope_theta"] = rope["rope_theta"]
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    flat["torch_dtype"] = flat.pop("dtype")
    return flat


def test_flat_and_nested_formats_parse_the_same(tiny_checkpoint: Path, tmp_path: Path) -> None:
    nested = json.loads((tiny_checkpoint / "config.json").read_text())
    flat_dir = tmp_path / "flat"
    flat_dir.mkdir()
    (flat_dir / "config.json").write_text(json.dumps(_flatten(nested)))
    from_nested = load_model_config(tiny_checkpoint)
    from_flat = load_model_config(flat_dir)
    assert "text_config" not in json.loads((flat_dir / "config.json").read_text())
    assert from_flat == from_nested
    assert from_nested.text.mrope_section == (2, 3, 3)
    assert from_nested.text.rope_theta == 10000.0
    assert from_nested.dtype == "float32"


def test_real_qwen2_vl_7b_config() -> None:
    cfg = parse_model_config(QWEN2_VL_7B, {"eos_token_id": [151645, 151643]})
    assert cfg.architecture == "Qwen2VLForConditionalGeneration"
    assert cfg.text.head_dim == 128 and cfg.text.num_key_value_heads == 4
    assert cfg.text.mrope_section == (16, 24, 24) and cfg.text.rope_theta == 1e6
    assert cfg.vision.embed_dim == 1280 and cfg.vision.mlp_hidden_dim == 5120
    assert cfg.vision.out_dim == 3584 and cfg.vision.hidden_act == "quick_gelu"
    assert not cfg.vision.is_windowed
    assert cfg.eos_token_ids == (151645, 151643)
    assert (cfg.image_token_id, cfg.vision_start_token_id) == (151655, 151652)
    assert cfg.dtype == "bfloat16"


def test_real_qwen2_5_vl_config_fields() -> None:
    raw = dict(QWEN2_VL_7B, architectures=["Qwen2_5_VLForConditionalGeneration"])
    raw["vision_config"] = {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    }
    cfg = parse_model_config(raw)
    assert cfg.vision.is_windowed and cfg.vision.fullatt_block_indexes == (7, 15, 23, 31)
    assert cfg.vision.embed_dim == 1280 and cfg.vision.mlp_hidden_dim == 3420
    assert cfg.vision.tokens_per_second == 2 and cfg.vision.window_size == 112


def test_inconsistent_config_is_refused() -> None:
    bad = dict(QWEN2_VL_7B, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 20]})
    with pytest.raises(ValueError, match="mrope_section"):
        parse_model_config(bad)


def test_kv_cache_bytes_per_block_matches_allocation(tiny_checkpoint: Path) -> None:
    cfg = load_model_config(tiny_checkpoint)
    caches = allocate_kv_caches(
        cfg, num_blocks=3, block_size=16, device="cpu", dtype=torch.bfloat16
    )
    assert len(caches) == cfg.text.num_hidden_layers
    assert caches[0].shape == (2, 3, 16, cfg.text.num_key_value_heads, cfg.text.head_dim)
    total = sum(c.numel() * c.element_size() for c in caches)
    assert kv_cache_bytes_per_block(cfg, 16, torch.bfloat16) * 3 == total
    # Qwen2-VL-7B: 28 layers x K,V x 16 tokens x 4 kv heads x 128 dims x 2 bytes
    real = parse_model_config(QWEN2_VL_7B)
    assert kv_cache_bytes_per_block(real, 16, torch.bfloat16) == 28 * 2 * 16 * 4 * 128 * 2
