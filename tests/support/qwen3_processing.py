"""A Qwen3-VL processor directory (no weights) and transformers' processor over it: the oracle
of the Qwen3-VL processing tests (prompt ids, patches, grids, M-RoPE positions).

The files are what a Qwen3-VL checkpoint ships: config.json, the tokenizer with the chat
template, preprocessor_config.json (Qwen2VLImageProcessor's, patch 16, mean/std 0.5, limits as
`size`) and video_preprocessor_config.json (Qwen3VLVideoProcessor's: `size` over all frames).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.factory import build_tokenizer, special_token_ids
from tests.support.processor_configs import (
    qwen3_vl_preprocessor_config,
    qwen3_vl_video_preprocessor_config,
)

IMAGE_MIN_PIXELS = 8 * 32 * 32
IMAGE_MAX_PIXELS = 64 * 32 * 32
VIDEO_MIN_PIXELS = 16 * 32 * 32
VIDEO_MAX_PIXELS = 96 * 32 * 32  # over all frames


def qwen3_preprocessor_config(
    min_pixels: int = IMAGE_MIN_PIXELS, max_pixels: int = IMAGE_MAX_PIXELS
) -> dict[str, Any]:
    return qwen3_vl_preprocessor_config(min_pixels, max_pixels)


def qwen3_video_preprocessor_config(
    min_pixels: int = VIDEO_MIN_PIXELS, max_pixels: int = VIDEO_MAX_PIXELS
) -> dict[str, Any]:
    return qwen3_vl_video_preprocessor_config(min_pixels, max_pixels)


def tiny_qwen3_vl_config(ids: dict[str, int], vocab_size: int) -> Any:
    """A tiny transformers Qwen3VLConfig (enough for get_rope_index and a processor dir)."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 32,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def write_qwen3_processor_dir(out_dir: str | Path) -> Path:
    """config.json, tokenizer files and both processor configs of a tiny Qwen3-VL checkpoint."""
    out = Path(out_dir)
    tok = build_tokenizer(out)
    vocab_size = ((tok.get_vocab_size() + 63) // 64) * 64
    config = tiny_qwen3_vl_config(special_token_ids(tok), vocab_size)
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    config.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(qwen3_preprocessor_config()))
    (out / "video_preprocessor_config.json").write_text(
        json.dumps(qwen3_video_preprocessor_config())
    )
    return out


def hf_qwen3_processor(model_dir: Path) -> Any:
    """transformers' Qwen3VLProcessor over the directory's files (PIL image backend, as
    mmserve resizes images with Pillow)."""
    from transformers import AutoTokenizer, Qwen3VLProcessor, Qwen3VLVideoProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    image_cfg = json.loads((model_dir / "preprocessor_config.json").read_text())
    video_path = model_dir / "video_preprocessor_config.json"
    # no video file: the class defaults (what mmserve reads then too)
    video_cfg = json.loads(video_path.read_text()) if video_path.is_file() else {}
    drop = ("image_processor_type", "video_processor_type", "processor_class")
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(
            **{k: v for k, v in image_cfg.items() if k not in drop}
        ),
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        video_processor=Qwen3VLVideoProcessor(
            **{k: v for k, v in video_cfg.items() if k not in drop}
        ),
    )


def hf_rope_index(model_dir: Path, input_ids: list[int], image_grids: list, video_grids: list):
    """transformers' get_rope_index of a Qwen3-VL model built from the directory's config:
    (positions [3, n] numpy, delta)."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLModel

    config = Qwen3VLConfig.from_pretrained(model_dir)
    model = Qwen3VLModel(config)
    ids = torch.tensor([input_ids])
    types = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
    positions, delta = model.get_rope_index(
        ids,
        mm_token_type_ids=types,
        image_grid_thw=torch.tensor(image_grids) if image_grids else None,
        video_grid_thw=torch.tensor(video_grids) if video_grids else None,
    )
    return positions[:, 0].numpy(), int(delta[0, 0])


def write_qwen3_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny random Qwen3-VL checkpoint (float32 safetensors from transformers' own
    initialisation, norms and biases perturbed) with the processor files above."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    out = write_qwen3_processor_dir(out_dir)
    config = tiny_qwen3_vl_config_from(out)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval().to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    return out


def tiny_qwen3_vl_config_from(model_dir: Path) -> Any:
    from transformers import Qwen3VLConfig

    config = Qwen3VLConfig.from_pretrained(model_dir)
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    return config
