"""Qwen3-VL pieces against transformers (float32): config parsing, interleaved M-RoPE, the
position table's bilinear taps, the vision tower with its DeepStack levels, the decoder."""

from __future__ import annotations

import json

import pytest
import torch

from mmserve.layers.rotary import MRotaryEmbedding, mrope_axes
from mmserve.models.config import parse_model_config
from mmserve.models.loader import load_model, load_vision_tower
from mmserve.models.qwen3_vl_vision import position_table_taps

# (t, h, w) in patches: larger and smaller than the 4x4 table, square, wide, tall, a clip
GRIDS = [(1, 6, 10), (2, 4, 4), (1, 24, 2), (1, 2, 2), (3, 8, 6)]


@pytest.fixture(scope="module")
def pair(qwen3_vl_dir):
    import transformers

    model, config = load_model(qwen3_vl_dir, dtype=torch.float32)
    hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        qwen3_vl_dir, dtype=torch.float32
    ).eval()
    return model, config, hf


def test_config_json_is_parsed_with_the_qwen3_shapes(qwen3_vl_dir) -> None:
    raw = json.loads((qwen3_vl_dir / "config.json").read_text())
    config = parse_model_config(raw)
    assert config.architecture == "Qwen3VLForConditionalGeneration"
    text, vision = config.text, config.vision
    assert text.head_dim == 24 != text.hidden_size // text.num_attention_heads
    assert text.qk_norm and text.mrope_interleaved and not text.attention_bias
    assert text.mrope_section == (6, 3, 3)
    assert vision.model_type == "qwen3_vl" and vision.patch_size == 16
    assert vision.patch_input_dim == 3 * 2 * 16 * 16
    assert vision.position_table_side == 4 and vision.deepstack_visual_indexes == (0, 1, 3)
    assert config.deepstack_levels == 3
    assert config.mm_embedding_width == 64 * 4
    assert config.tie_word_embeddings


def test_the_hub_layout_parses_too_and_bad_vision_fields_are_named(qwen3_vl_dir) -> None:
    raw = json.loads((qwen3_vl_dir / "config.json").read_text())
    # the hub's Qwen3-VL files keep the rope settings in rope_scaling
    text = dict(raw["text_config"])
    text["rope_scaling"] = text.pop("rope_parameters")
    config = parse_model_config({**raw, "text_config": text})
    assert config.text.mrope_section == (6, 3, 3) and config.text.rope_theta == 5000.0
    for field, value, message in [
        ("num_position_embeddings", 15, "must be a positive square"),
        ("deepstack_visual_indexes", [1, 4], r"\[4\] are not blocks of a depth-4 tower"),
    ]:
        bad = {**raw, "vision_config": {**raw["vision_config"], field: value}}
        with pytest.raises(ValueError, match=message):
            parse_model_config(bad)


# Qwen3-VL-8B-Instruct's config.json as the hub publishes it (transformers 4.57 layout)
HUB_8B = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "bos_token_id": 151643,
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "mrope_interleaved": True,
            "mrope_section": [24, 20, 20],
            "rope_type": "default",
        },
        "rope_theta": 5000000,
        "tie_word_embeddings": False,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": False,
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "intermediate_size": 4304,
        "model_type": "qwen3_vl",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 4096,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}


def test_the_8b_hub_config_is_read_with_its_real_shapes() -> None:
    config = parse_model_config(HUB_8B, {"eos_token_id": [151645, 151643]})
    text, vision = config.text, config.vision
    assert (text.head_dim, text.num_key_value_heads, text.rope_theta) == (128, 8, 5e6)
    assert text.mrope_section == (24, 20, 20) and text.mrope_interleaved and text.qk_norm
    assert vision.head_dim == 72 and vision.position_table_side == 48
    assert vision.hidden_act == "gelu_pytorch_tanh" and vision.mlp_hidden_dim == 4304
    assert config.deepstack_levels == 3 and config.mm_embedding_width == 4096 * 4
    assert config.eos_token_ids == (151645, 151643) and not config.tie_word_embeddings
    assert config.dtype == "bfloat16"


@pytest.mark.parametrize(
    ("section", "head_dim"), [((6, 3, 3), 24), ((24, 20, 20), 128), ((4, 4, 4), 24)]
)
def test_interleaved_mrope_matches_transformers(section, head_dim) -> None:
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    hf_config = Qwen3VLTextConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000.0,
            "mrope_section": list(section),
            "mrope_interleaved": True,
        },
    )
    hf_rotary = Qwen3VLTextRotaryEmbedding(hf_config)
    ours = MRotaryEmbedding(head_dim, 5000.0, section, interleaved=True)
    positions = torch.randint(0, 300, (3, 37))
    hf_cos, hf_sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    cos, sin = ours(positions)
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-6)
    assert ours._axis(torch.device("cpu")).tolist() == mrope_axes(section, interleaved=True)


def test_interleaving_spreads_the_axes_and_contiguous_stays_as_it_was() -> None:
    assert mrope_axes((6, 3, 3), True) == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 0, 0]
    assert mrope_axes((6, 3, 3), False) == [0] * 6 + [1] * 3 + [2] * 3
    contiguous = MRotaryEmbedding(24, 10000.0, (6, 3, 3))
    assert contiguous._axis(torch.device("cpu")).tolist() == mrope_axes((6, 3, 3), False)


def test_the_position_table_taps_are_transformers_bilinear_resampling() -> None:
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    for side in (4, 48):
        index, weight = position_table_taps(GRIDS, side, merge=2)
        hf_index, hf_weight = get_vision_interpolation_indices_and_weights(
            torch.tensor(GRIDS), side, mode="bilinear", align_corners=True, spatial_merge_size=2
        )
        assert torch.equal(index, hf_index)
        torch.testing.assert_close(weight, hf_weight, rtol=0, atol=0)


def test_the_vision_tower_returns_main_then_each_deepstack_level(pair) -> None:
    model, config, hf = pair
    num_patches = sum(t * h * w for t, h, w in GRIDS)
    pixels = torch.randn(
        num_patches, config.vision.patch_input_dim, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ours = model.embed_multimodal(pixels, GRIDS)
        out = hf.model.visual(pixels, grid_thw=torch.tensor(GRIDS))
    reference = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
    assert [e.shape for e in ours] == [
        (t * h * w // 4, config.mm_embedding_width) for t, h, w in GRIDS
    ]
    torch.testing.assert_close(torch.cat(ours), reference, rtol=0, atol=1e-4)


def test_the_tower_alone_loads_only_visual_tensors(qwen3_vl_dir, pair) -> None:
    model, config, _ = pair
    tower, _ = load_vision_tower(qwen3_vl_dir, dtype=torch.float32)
    pixels = torch.randn(6 * 10, config.vision.patch_input_dim)
    with torch.no_grad():
        torch.testing.assert_close(
            tower(pixels, [(1, 6, 10)]), model.visual(pixels, [(1, 6, 10)]), rtol=0, atol=0
        )


def test_tied_checkpoint_has_no_lm_head_and_reuses_the_embedding(qwen3_vl_dir, pair) -> None:
    from safetensors import safe_open

    model, _, _ = pair
    with safe_open(str(qwen3_vl_dir / "model.safetensors"), "pt") as f:
        assert not any("lm_head" in key for key in f.keys())  # noqa: SIM118
    assert model.lm_head is None
    hidden = torch.randn(3, 64)
    assert torch.equal(model.compute_logits(hidden), hidden @ model.model.embed_tokens.weight.t())


def test_rows_of_the_wrong_width_are_refused_by_name(pair) -> None:
    model, config, _ = pair
    ids = torch.tensor([1, config.image_token_id, 2])
    with pytest.raises(ValueError, match="rows have 64 values, this model's are 256"):
        model.embed_input_ids(ids, torch.zeros(1, 64), torch.tensor([1]))


def test_encoder_cuda_graphs_are_refused_for_the_qwen3_tower(qwen3_vl_dir) -> None:
    """Their static buffers hold the Qwen2 tower's metadata only: refused by name, not run."""
    from mmserve import LLM

    with pytest.raises(ValueError, match="not Qwen3VisionTransformer. Drop the flag"):
        LLM(model=str(qwen3_vl_dir), device="cpu", enable_encoder_cuda_graph=True)
