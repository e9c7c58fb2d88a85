"""Builders shared by every test: a locally trained BPE tokenizer and tiny random checkpoints.

Nothing here touches the network. `write_tiny_checkpoint` produces a directory in Hugging Face
format (config.json, safetensors, tokenizer.json, tokenizer_config.json with the chat template,
preprocessor_config.json) that both mmserve and transformers load.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# re-exported: the checkpoints' tokens and template, importable without mmserve
from tests.support.chat_tokens import QWEN2_VL_CHAT_TEMPLATE, SPECIAL_TOKENS  # noqa: E402,F401

# re-exported: tests import the pixel values beside the checkpoints and media
from tests.support.pixels import (  # noqa: E402,F401
    CLIP_NORMALIZATION,
    CLIP_VIDEO_NORMALIZATION,
    LEVELS_AS_FLOATS,
    uint8_patches,
)
from tests.support.processor_configs import preprocessor_config, qwen3_vl_preprocessor_config

DEFAULT_CORPUS = [
    "You are a helpful assistant.",
    "What is in the image? Describe this picture in detail.",
    "The quick brown fox jumps over the lazy dog.",
    "a red circle, a blue square, a green triangle, a yellow star in the top left corner",
    "Which image shows a circle? The first. The second. Are the two shapes the same colour?",
    "system user assistant hello world 0123456789 , . ! ? : ; ( ) [ ] { } - + = * / \\ ' \"",
]


def build_tokenizer(
    out_dir: str | Path,
    corpus: Iterable[str] = DEFAULT_CORPUS,
    vocab_size: int = 400,
    chat_template: str = QWEN2_VL_CHAT_TEMPLATE,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer with the Qwen2-VL special tokens and save it to out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "Qwen2TokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "chat_template": chat_template,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return tok


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert all(v is not None for v in ids.values())
    return ids  # type: ignore[return-value]


# Qwen3-VL's tiny shapes are odd on purpose: text head_dim 24 (not hidden / heads = 16),
# interleaved M-RoPE sections [6, 3, 3], vision head_dim 12, three DeepStack levels (blocks 0,
# 1 and 3 of 4) added after decoder layers 0-2 of 4, a 4x4 position table (smaller than most
# grids), tied embeddings (no lm_head tensor).
QWEN3_VL_TEXT = {
    "head_dim": 24,
    "num_hidden_layers": 4,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5000.0,
        "mrope_section": [6, 3, 3],
        "mrope_interleaved": True,
    },
    "tie_word_embeddings": True,
}
QWEN3_VL_VISION = {
    "depth": 4,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_heads": 4,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "hidden_act": "gelu_pytorch_tanh",
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0, 1, 3],
}


def tiny_config_dict(arch: str, vocab_size: int, ids: dict[str, int], **overrides: Any) -> dict:
    """A nested (text_config / vision_config) config dict for a tiny model of `arch`."""
    text = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": False,
    }
    if arch == "qwen2_vl":
        vision = {
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": text["hidden_size"],
            "mlp_ratio": 2,
            "num_heads": 4,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        }
        architectures, model_type = ["Qwen2VLForConditionalGeneration"], "qwen2_vl"
    elif arch == "qwen2_5_vl":
        vision = {
            "depth": 4,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 4,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": text["hidden_size"],
            "window_size": 56,
            "fullatt_block_indexes": [1, 3],
            "tokens_per_second": 2,
            "hidden_act": "silu",
        }
        architectures, model_type = ["Qwen2_5_VLForConditionalGeneration"], "qwen2_5_vl"
    elif arch == "qwen3_vl":
        text.update(QWEN3_VL_TEXT)
        vision = {**QWEN3_VL_VISION, "out_hidden_size": text["hidden_size"]}
        architectures, model_type = ["Qwen3VLForConditionalGeneration"], "qwen3_vl"
    else:
        raise ValueError(f"unknown arch {arch!r}")
    text.update(overrides.pop("text", {}))
    vision.update(overrides.pop("vision", {}))
    cfg = {
        "architectures": architectures,
        "model_type": model_type,
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": text["tie_word_embeddings"],
        "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def write_tiny_checkpoint(
    out_dir: str | Path,
    arch: str = "qwen2_vl",
    seed: int = 0,
    min_pixels: int = 56 * 56,
    max_pixels: int = 16384 * 28 * 28,
    dtype: str = "float32",
    device: str = "cpu",
    **overrides: Any,
) -> Path:
    """Write a tiny random checkpoint of `arch` ("qwen2_vl", "qwen2_5_vl", "qwen3_vl") to out_dir.

    Weights come from transformers' own initialisation (seeded), saved as safetensors, so the
    directory is exactly what `save_pretrained` would publish. Returns the directory. `dtype`
    and `device` are for full-size shapes (benchmarks/gpu_suite.py): a 7B model initialised on
    a GPU and saved in bfloat16 takes seconds, in float32 on a CPU minutes.
    """
    import torch
    import transformers

    out = Path(out_dir)
    tok = build_tokenizer(out)
    ids = special_token_ids(tok)
    vocab_size = ((tok.get_vocab_size() + 63) // 64) * 64
    cfg_dict = tiny_config_dict(arch, vocab_size, ids, **{"torch_dtype": dtype, **overrides})
    cls_name = cfg_dict["architectures"][0]
    config_cls = {
        "qwen2_vl": transformers.Qwen2VLConfig,
        "qwen2_5_vl": transformers.Qwen2_5_VLConfig,
        "qwen3_vl": transformers.Qwen3VLConfig,
    }[arch]
    config = config_cls(**{k: v for k, v in cfg_dict.items() if k != "architectures"})
    config.architectures = cfg_dict["architectures"]
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, cls_name)(config).eval().to(getattr(torch, dtype))
    with torch.no_grad():
        # transformers initialises norms to ones and biases to zeros; perturb them so that a
        # loader that forgets a norm or a bias fails the parity tests.
        for _name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    make_preprocessor = qwen3_vl_preprocessor_config if arch == "qwen3_vl" else preprocessor_config
    (out / "preprocessor_config.json").write_text(
        json.dumps(make_preprocessor(min_pixels, max_pixels), indent=2)
    )
    return out


def random_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    if channels == 1:
        arr = arr[:, :, 0]
    return Image.fromarray(arr, mode=mode)


def png_bytes(width: int = 32, height: int = 24, seed: int = 0) -> bytes:
    """`random_image(width, height, seed)` as a PNG file."""
    import io

    buf = io.BytesIO()
    random_image(width, height, seed=seed).save(buf, format="PNG")
    return buf.getvalue()


# PNG (bit depth, colour type, bytes per row) of the modes `flat_png` writes.
_PNG_LAYOUTS = {
    "1": (1, 0, 1 / 8),
    "L": (8, 0, 1),
    "P": (8, 3, 1),
    "RGB": (8, 2, 3),
    "RGBA": (8, 6, 4),
}


def flat_png(width: int, height: int, mode: str = "1") -> bytes:
    """A valid PNG of one flat colour, written row by row without building the image in memory:
    a 9000x9000 1-bit picture is a few KB on the wire and 81 MP once decoded."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    bit_depth, colour_type, row_factor = _PNG_LAYOUTS[mode]
    row = b"\0" + b"\x55" * -(-int(width * row_factor * 8) // 8)  # filter byte + pixels
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    palette = chunk(b"PLTE", bytes(range(256)) * 3) if mode == "P" else b""
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + palette
        + chunk(b"IDAT", idat)
        + chunk(b"IEND", b"")
    )


def video_frames(num_frames: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """[T, H, W, 3] uint8 frames: a smooth gradient that moves, plus a little noise (video
    codecs keep it recognisable, and each frame differs)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    for t in range(num_frames):
        base = np.stack([x * 3 + t * 9, y * 3 + t * 5, (x + y + t * 7) * 2], axis=-1)
        frames[t] = (base + rng.integers(0, 8, base.shape)) % 256
    return frames


def video_bytes(
    num_frames: int = 8,
    width: int = 64,
    height: int = 48,
    fps: int = 4,
    *,
    codec: str = "mpeg4",
    container: str = "mp4",
    seed: int = 0,
    seconds_per_frame: int | None = None,
) -> bytes:
    """A small real video made with PyAV. `seconds_per_frame`: frames that far apart in time
    (a long video that stays a few KB: the 10-hour container of the hostile tests)."""
    import io
    from fractions import Fraction

    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if seconds_per_frame is not None:
            stream.codec_context.time_base = Fraction(1, 1)
        for t, arr in enumerate(video_frames(num_frames, width, height, seed)):
            frame = av.VideoFrame.from_ndarray(arr, format="rgb24")
            if seconds_per_frame is not None:
                frame.pts, frame.time_base = t * seconds_per_frame, Fraction(1, 1)
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue()


def huge_frame_header(side: int = 8000) -> bytes:
    """A few-KB AVI of raw 16x16 frames whose header says side x side: the dimensions of a raw
    stream come from the header alone, so it is what a decoder would allocate for."""
    import io
    import struct

    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="avi") as out:
        stream = out.add_stream("rawvideo", rate=2)
        stream.width = stream.height = 16
        stream.pix_fmt = "yuv420p"
        for i in range(4):
            frame = av.VideoFrame.from_ndarray(np.full((16, 16, 3), i * 40, np.uint8), "rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue().replace(struct.pack("<ii", 16, 16), struct.pack("<ii", side, side))
