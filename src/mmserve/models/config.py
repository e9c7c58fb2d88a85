"""Model configuration parsed from a Hugging Face `config.json` (flat hub or nested v5 format)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Architectures this package can build; the registry maps each to its class.
QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
QWEN3_VL = "Qwen3VLForConditionalGeneration"
SUPPORTED_ARCHITECTURES = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL)
# The vision tower each architecture needs (`VisionConfig.model_type`).
VISION_MODEL_TYPES = {QWEN2_VL: "qwen2_vl", QWEN2_5_VL: "qwen2_5_vl", QWEN3_VL: "qwen3_vl"}


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower (ViT + 2x2 patch merger).

    `embed_dim` is the ViT width (Qwen2-VL `embed_dim`, Qwen2.5-VL and Qwen3-VL `hidden_size`),
    `out_dim` the merger's output width (= the language model's hidden size). `window_size` is
    in pixels and only used by Qwen2.5-VL (`is_windowed`); blocks in `fullatt_block_indexes`
    attend over the whole image, the others within windows. Qwen3-VL adds a learned absolute
    position table of `num_position_embeddings` (a square) and DeepStack mergers.
    """

    model_type: str  # "qwen2_vl", "qwen2_5_vl" or "qwen3_vl": selects the block structure
    depth: int
    embed_dim: int
    num_heads: int
    mlp_hidden_dim: int
    out_dim: int
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "quick_gelu"
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()
    tokens_per_second: float | None = None
    rope_theta: float = 10000.0
    # vision blocks whose outputs feed DeepStack mergers (Qwen3-VL); empty: no DeepStack
    deepstack_visual_indexes: tuple[int, ...] = ()
    # Qwen3-VL's learned position table: side x side entries, resampled to each grid; 0: none
    num_position_embeddings: int = 0

    def __post_init__(self) -> None:
        if self.model_type not in VISION_MODEL_TYPES.values():
            raise ValueError(
                f"vision model_type must be one of {sorted(VISION_MODEL_TYPES.values())}, "
                f"got {self.model_type!r}"
            )
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"vision embed_dim ({self.embed_dim}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        if self.is_windowed and self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ValueError(
                f"vision window_size ({self.window_size}) must be a multiple of patch_size * "
                f"spatial_merge_size ({self.patch_size * self.spatial_merge_size})"
            )
        side = math.isqrt(self.num_position_embeddings)
        if self.model_type == "qwen3_vl" and (
            side < 1 or side * side != self.num_position_embeddings
        ):
            raise ValueError(
                f"vision num_position_embeddings ({self.num_position_embeddings}) must be a "
                "positive square (a side x side table)"
            )
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(
                f"vision deepstack_visual_indexes {bad} are not blocks of a "
                f"depth-{self.depth} tower"
            )

    @property
    def position_table_side(self) -> int:
        """Side of Qwen3-VL's square learned position table (0 without one)."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def is_windowed(self) -> bool:
        return self.model_type == "qwen2_5_vl"

    @property
    def patch_input_dim(self) -> int:
        """Length of one flattened input patch: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class TextConfig:
    """The decoder: GQA attention, M-RoPE, RMSNorm, SwiGLU MLP.

    Qwen2 (`qk_norm` False): q/k/v biases, M-RoPE sections contiguous. Qwen3 (`qk_norm` True):
    per-head RMSNorm on q and k, biases on q/k/v/o only with `attention_bias`, and interleaved
    M-RoPE sections (`mrope_interleaved`, see layers/rotary.py).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    qk_norm: bool = False
    attention_bias: bool = False  # Qwen3 only; Qwen2 always has q/k/v biases
    mrope_interleaved: bool = False

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if len(self.mrope_section) != 3 or sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(
                f"mrope_section {list(self.mrope_section)} must have 3 entries summing to "
                f"head_dim / 2 = {self.head_dim // 2}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about a checkpoint, read once from its directory."""

    architecture: str
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"  # the checkpoint's torch dtype name ("bfloat16", "float32", ...)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.vision.model_type != VISION_MODEL_TYPES[self.architecture]:
            raise ValueError(
                f"{self.architecture} needs a {VISION_MODEL_TYPES[self.architecture]} vision "
                f"config, got {self.vision.model_type}"
            )
        if self.vision.out_dim != self.text.hidden_size:
            raise ValueError(
                f"vision out_dim ({self.vision.out_dim}) must equal the language model's "
                f"hidden_size ({self.text.hidden_size})"
            )

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def num_hidden_layers(self) -> int:
        return self.text.num_hidden_layers

    @property
    def spatial_merge_size(self) -> int:
        return self.vision.spatial_merge_size

    @property
    def deepstack_levels(self) -> int:
        """How many extra per-layer embeddings the vision tower returns per token besides the
        main one (Qwen3-VL's DeepStack; 0 for Qwen2-VL and Qwen2.5-VL)."""
        return len(self.vision.deepstack_visual_indexes)

    @property
    def mm_embedding_width(self) -> int:
        """Values per row of an item's encoder output: the main embedding then every DeepStack
        level, concatenated along the last dimension ([tokens, hidden * (1 + levels)]). The
        encoder cache, its byte ledger, the encode/prefill wire and the pool carry rows of this
        width; only the model splits them."""
        return self.text.hidden_size * (1 + self.deepstack_levels)


def _rope_dict(text: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Merge every place a checkpoint may keep its rope settings (v5 first, then older keys)."""
    merged: dict[str, Any] = {}
    for source in (top, text):
        for key in ("rope_scaling", "rope_parameters"):
            value = source.get(key)
            if isinstance(value, dict):
                merged.update(value)
        if "rope_theta" in source:
            merged.setdefault("rope_theta", source["rope_theta"])
    return merged


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for item in value if isinstance(value, list | tuple) else [value]:
            if isinstance(item, int) and item not in ids:
                ids.append(item)
    return tuple(ids)


def _parse_text(text: dict[str, Any], top: dict[str, Any], architecture: str) -> TextConfig:
    rope = _rope_dict(text, top)
    num_heads = int(text["num_attention_heads"])
    hidden_size = int(text["hidden_size"])
    # Qwen2 derives head_dim from hidden_size; a checkpoint may state it explicitly.
    head_dim = int(text.get("head_dim") or hidden_size // num_heads)
    section = rope.get("mrope_section")
    if section is None:
        raise ValueError(
            "config.json has no mrope_section (expected in rope_scaling or rope_parameters); "
            "Qwen2-VL checkpoints need it for M-RoPE"
        )
    return TextConfig(
        vocab_size=int(text["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(text["intermediate_size"]),
        num_hidden_layers=int(text["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", 1000000.0)),
        mrope_section=tuple(int(s) for s in section),  # type: ignore[arg-type]
        hidden_act=str(text.get("hidden_act", "silu")),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        # Qwen3-VL: transformers interleaves the M-RoPE sections whatever `mrope_interleaved`
        # says, and every Qwen3 decoder norms q and k per head.
        qk_norm=architecture == QWEN3_VL,
        attention_bias=bool(text.get("attention_bias", False)) and architecture == QWEN3_VL,
        mrope_interleaved=architecture == QWEN3_VL,
    )


def _parse_vision(vision: dict[str, Any], architecture: str, text_hidden: int) -> VisionConfig:
    common = {
        "depth": int(vision["depth"]),
        "num_heads": int(vision["num_heads"]),
        "in_channels": int(vision.get("in_channels", vision.get("in_chans", 3))),
        "patch_size": int(vision.get("patch_size", 14)),
        "temporal_patch_size": int(vision.get("temporal_patch_size", 2)),
        "spatial_merge_size": int(vision.get("spatial_merge_size", 2)),
        "rope_theta": float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
    }
    if architecture == QWEN3_VL:
        return VisionConfig(
            model_type="qwen3_vl",
            embed_dim=int(vision["hidden_size"]),
            mlp_hidden_dim=int(vision["intermediate_size"]),
            out_dim=int(vision.get("out_hidden_size", text_hidden)),
            hidden_act=str(vision.get("hidden_act", "gelu_pytorch_tanh")),
            deepstack_visual_indexes=tuple(
                int(i) for i in vision.get("deepstack_visual_indexes", (8, 16, 24))
            ),
            num_position_embeddings=int(vision.get("num_position_embeddings", 2304)),
            **{**common, "patch_size": int(vision.get("patch_size", 16))},
        )
    if architecture == QWEN2_VL:
        embed_dim = int(vision["embed_dim"])
        return VisionConfig(
            model_type="qwen2_vl",
            embed_dim=embed_dim,
            mlp_hidden_dim=int(embed_dim * vision.get("mlp_ratio", 4)),
            # The vision `hidden_size` of Qwen2-VL is the merger's output width.
            out_dim=int(vision.get("hidden_size", text_hidden)),
            hidden_act=str(vision.get("hidden_act", "quick_gelu")),
            **common,
        )
    return VisionConfig(
        model_type="qwen2_5_vl",
        embed_dim=int(vision["hidden_size"]),
        mlp_hidden_dim=int(vision["intermediate_size"]),
        out_dim=int(vision.get("out_hidden_size", text_hidden)),
        hidden_act=str(vision.get("hidden_act", "silu")),
        window_size=int(vision.get("window_size", 112)),
        fullatt_block_indexes=tuple(int(i) for i in vision.get("fullatt_block_indexes", ())),
        tokens_per_second=float(vision.get("tokens_per_second", 4)),
        **common,
    )


def parse_model_config(
    raw: dict[str, Any], generation: dict[str, Any] | None = None
) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json (and optionally generation_config.json).

    Accepts the flat hub format (text fields at top level, `rope_scaling` with `mrope_section`)
    and the nested transformers-5 format (`text_config`, `rope_parameters`). End-of-sequence ids
    are the union of config.json's and generation_config.json's.
    """
    architectures = raw.get("architectures") or []
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        raise ValueError(
            f"config.json architectures {architectures} name no supported architecture; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    text_raw = raw.get("text_config") or raw  # nested v5 format, else flat
    if "vision_config" not in raw:
        raise ValueError("config.json has no vision_config")
    text = _parse_text(text_raw, raw, architecture)
    vision = _parse_vision(raw["vision_config"], architecture, text.hidden_size)
    tie = bool(raw.get("tie_word_embeddings", False) or text_raw.get("tie_word_embeddings", False))
    dtype = raw.get("torch_dtype") or raw.get("dtype") or text_raw.get("torch_dtype")
    dtype = dtype or text_raw.get("dtype") or "bfloat16"
    generation = generation or {}
    return ModelConfig(
        architecture=architecture,
        text=text,
        vision=vision,
        image_token_id=int(raw.get("image_token_id", text_raw.get("image_token_id", 151655))),
        video_token_id=int(raw.get("video_token_id", text_raw.get("video_token_id", 151656))),
        vision_start_token_id=int(raw.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(raw.get("vision_end_token_id", 151653)),
        eos_token_ids=_eos_ids(
            raw.get("eos_token_id"), text_raw.get("eos_token_id"), generation.get("eos_token_id")
        ),
        tie_word_embeddings=tie,
        dtype=str(dtype),
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read `config.json` (and `generation_config.json` when present) from a model directory."""
    path = Path(model_dir)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: a model directory needs a config.json")
    raw = json.loads(config_path.read_text())
    generation_path = path / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else None
    return parse_model_config(raw, generation)
