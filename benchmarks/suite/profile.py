"""Sizes of every section: the real shapes on a GPU, tiny ones for the CPU smoke run (CI)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Qwen2-VL-2B-Instruct and -7B-Instruct as published (config.json), random weights.
QWEN2_VL_2B: dict[str, Any] = {
    "text": {
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": [16, 24, 24],
        },
    },
    "vision": {
        "depth": 32,
        "embed_dim": 1280,
        "hidden_size": 1536,
        "mlp_ratio": 4,
        "num_heads": 16,
    },
    "tie_word_embeddings": True,
}
QWEN2_VL_7B: dict[str, Any] = {
    "text": {
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": [16, 24, 24],
        },
    },
    "vision": {
        "depth": 32,
        "embed_dim": 1280,
        "hidden_size": 3584,
        "mlp_ratio": 4,
        "num_heads": 16,
    },
}
# Qwen2-VL-2B's layer widths, for rows that build a few layers only (suite/compile_ab.py)
QWEN2_VL_2B_LAYERS: dict[str, Any] = {
    "text": {
        k: QWEN2_VL_2B["text"][k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "rope_parameters",
        )
    },
    "vision": {k: v for k, v in QWEN2_VL_2B["vision"].items() if k != "depth"},
}
# Qwen3-VL-8B-Instruct's shapes (config.json), built with mmserve's Qwen3-VL classes: the
# vision tower (VisionConfig fields: patch 16, 16 heads of 72, three DeepStack mergers) and the
# language model's checkpoint (written by tests/support/factory.py, random weights).
QWEN3_VL_8B_VISION: dict[str, Any] = {
    "depth": 27,
    "embed_dim": 1152,
    "num_heads": 16,
    "mlp_hidden_dim": 4304,
    "out_dim": 4096,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "deepstack_visual_indexes": (8, 16, 24),
    "num_position_embeddings": 2304,
}
QWEN3_VL_8B_LM: dict[str, Any] = {
    "text": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
    },
    # the factory's tiny tower, its mergers widened to the LM: decode never runs it
    "vision": {"out_hidden_size": 4096},
}
# Smoke stand-ins: the factory's tiny defaults, tied like the real 2B / deeper like the 7B, so
# that every code path of the GPU run (checkpoint writing, both engines, the weight-byte
# accounting of tied and untied heads) runs in seconds on a CPU.
TINY_2B: dict[str, Any] = {"text": {"tie_word_embeddings": True}, "tie_word_embeddings": True}
TINY_7B: dict[str, Any] = {"text": {"intermediate_size": 192, "num_hidden_layers": 3}}
# Head dims that are not powers of two in the smoke run too: 24 in the tower and the LM (the
# factory's tiny Qwen3-VL states head_dim 24 for 4 heads of a 64-wide model).
TINY_Q3_VISION: dict[str, Any] = {
    **QWEN3_VL_8B_VISION,
    "depth": 3,
    "embed_dim": 48,
    "num_heads": 2,
    "mlp_hidden_dim": 64,
    "out_dim": 96,
    "deepstack_visual_indexes": (0, 1),
    "num_position_embeddings": 16,
}
TINY_Q3_LM: dict[str, Any] = {
    "text": {"intermediate_size": 192, "num_hidden_layers": 3, "tie_word_embeddings": False}
}


@dataclass(frozen=True)
class CheckpointSpec:
    name: str  # "toy", "qwen2_vl_2b", "qwen2_vl_7b"
    overrides: dict[str, Any] | None  # None: the bundled toy checkpoint
    check_fp32: bool  # also run bf16-vs-fp32 agreement (a float32 copy of 7B is 33 GB)


@dataclass(frozen=True)
class Profile:
    """Everything the sections size themselves by; `smoke` is the CPU run of CI."""

    smoke: bool
    device: str
    dtype: str  # the dtype parity and speed are measured in
    budget_s: float
    checkpoints: tuple[CheckpointSpec, ...]
    gemm_size: int  # M = N = K of the peak matmul
    gemm_repeats: int
    copy_bytes: int  # buffer of the bandwidth copy
    copy_repeats: int
    parity_tokens: int  # K: greedy tokens compared per prompt
    decode_batches: tuple[int, ...]
    decode_steps: tuple[int, int]  # max_tokens of the short and the long run
    decode_repeats: int  # (short, long) pairs per batch size; the fastest counts
    decode_batch_cap_s: float  # no further repeat once a batch size has taken this long
    decode_prompt_tokens: int
    kv_cache_memory_bytes: int
    vit_images: tuple[tuple[int, int], ...]  # (width, height)
    vit_repeats: int
    vit_shape: dict[str, int] = field(default_factory=dict)
    # encoder graphs vs eager: vit_images[0] and a batch of thumbnails of this (width, height)
    vit_thumbnail: tuple[int, int] = (224, 224)
    vit_thumbnail_batch: int = 8
    compare_requests: int = 32
    compare_output_len: int = 32
    gpu_tests_timeout_s: float = 150.0
    # Fused layer ops against torch: token counts per call, timing repeats, the LM's dims.
    layer_ops_tokens: tuple[int, ...] = (1, 64, 2048)
    layer_ops_repeats: int = 5
    layer_ops_calls: int = 20  # calls per timing: one call is microseconds
    layer_ops_shape: dict[str, int] = field(default_factory=dict)
    # Qwen3-VL-8B rows: the tower's shape (VisionConfig fields) and the image it encodes, the
    # language model's checkpoint (decoded at `decode_batches`, then deleted)
    q3_vit_shape: dict[str, Any] = field(default_factory=dict)
    q3_vit_image: tuple[int, int] = (1024, 1024)
    q3_lm: CheckpointSpec | None = None
    # torch.compile against eager (suite/compile_ab.py): layer shape (tests' factory overrides,
    # {} = its tiny model), depth, the ViT's image, decode batches, A/B pairs per row
    compile_shape: dict[str, Any] = field(default_factory=dict)
    compile_layers: int = 2
    compile_image: tuple[int, int] = (112, 112)
    compile_batches: tuple[int, ...] = (1, 8)
    compile_pairs: int = 1
    # torch.compile's backend: inductor, as the engine runs it; the CPU smoke run traces with
    # aot_eager (the section's code, dynamo's graphs and guards, without ~20 s of C++ builds;
    # tests/execution/test_compile.py covers inductor on the CPU)
    compile_backend: str = "inductor"
    # tensor parallelism's throughput run: greedy prompts x tokens each (suite/tensor_parallel.py)
    tp_prompts: int = 16
    tp_tokens: int = 32
    # Rough seconds of each section on this profile's machine, to skip what no longer fits.
    estimates_s: dict[str, float] = field(default_factory=dict)


GPU = Profile(
    smoke=False,
    device="cuda",
    dtype="bfloat16",
    budget_s=530.0,
    checkpoints=(
        CheckpointSpec("toy", None, check_fp32=True),
        CheckpointSpec("qwen2_vl_2b", QWEN2_VL_2B, check_fp32=True),
        CheckpointSpec("qwen2_vl_7b", QWEN2_VL_7B, check_fp32=False),
    ),
    gemm_size=8192,
    gemm_repeats=20,
    copy_bytes=4 << 30,
    copy_repeats=20,
    parity_tokens=16,
    decode_batches=(1, 8, 64),
    decode_steps=(4, 36),
    decode_repeats=2,
    decode_batch_cap_s=15.0,
    decode_prompt_tokens=64,
    kv_cache_memory_bytes=8 << 30,
    vit_images=((1024, 1024), (3840, 2160)),
    vit_repeats=3,
    vit_shape={
        "depth": 32,
        "embed_dim": 1280,
        "num_heads": 16,
        "mlp_hidden_dim": 5120,
        "out_dim": 3584,
    },
    q3_vit_shape=QWEN3_VL_8B_VISION,
    q3_lm=CheckpointSpec("qwen3_vl_8b_lm", QWEN3_VL_8B_LM, check_fp32=False),
    compare_requests=32,
    compare_output_len=32,
    gpu_tests_timeout_s=150.0,  # the most; the section gets what the others left
    layer_ops_shape={
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_heads": 28,
        "num_kv_heads": 4,
        "head_dim": 128,
        "num_layers": 28,
    },
    # From the shapes (H200: ~800 TFLOP/s, ~4.2 TB/s; 16.6 GB of 7B and 4.4 GB of 2B weights,
    # each 7B load ~10 s with its engine's start, Triton's first compiles ~20 s once):
    #   peaks       1.1 TFLOP x 160 matmuls + 4 GiB x 20 copies                 ~3 s
    #   vit         1024^2 (12 TFLOP) and 4K (346 TFLOP) x (1 + 3), tower built  ~15 s
    #   layer_ops   3 ops x 3 token counts x 2 paths, compiles                    ~15 s
    #   checkpoints 21 GB written in bf16                                         ~45 s
    #   decode      two 7B engines (torch, triton + 11 graphs), 3 batches x 2 x
    #               (4 + 36) steps                                                ~80 s
    #   parity      toy, 2B (+ fp32), 7B: mmserve and transformers each           ~90 s
    #   compare_hf  a 7B mmserve and a 7B transformers run of 32 x 32 tokens      ~60 s
    #   graphs      one eager 7B engine (the graphs' run is decode's), the tower
    #               with graphs, two 2B engines on images                        ~60 s
    #   vit_q3      the Qwen3-VL-8B tower (27 blocks of 1152) on 1024^2 x (1 + 3)  ~10 s
    #   decode_q3   16.4 GB of Qwen3-VL-8B written in bf16, one engine (triton + graphs),
    #               3 batches x 2 x (4 + 36) steps                               ~70 s
    #   compile     4 blocks / layers of 2B width compiled (inductor + Triton, cold cache),
    #               ViT 1024^2 and decode at 1/8/64, 5 pairs each                ~40 s
    #   tensor_parallel  a 2B engine at TP=1, 16 x 32 tokens (TP=2 only with two GPUs,
    #               then a second engine over NCCL), the 2B already written      ~10 s
    # ~520 s with the environment: the gpu tests get the rest of 530 s, at least 10 s.
    compile_shape=QWEN2_VL_2B_LAYERS,
    compile_layers=4,
    compile_image=(1024, 1024),
    compile_batches=(1, 8, 64),
    compile_pairs=5,
    estimates_s={
        "compile": 40,
        "peaks": 10,
        "vit": 20,
        "vit_q3": 10,
        "layer_ops": 15,
        "checkpoints": 45,
        "decode": 80,
        "decode_q3": 70,
        "parity": 90,
        "compare_hf": 60,
        "graphs": 60,
        "tensor_parallel": 10,
        "gpu_tests": 10,
    },
)

SMOKE = Profile(
    smoke=True,
    device="cpu",
    dtype="float32",
    budget_s=50.0,
    checkpoints=(
        CheckpointSpec("toy", None, check_fp32=True),
        # bf16-vs-fp32 on the toy only: each extra engine costs seconds on two CPU cores.
        CheckpointSpec("qwen2_vl_2b", TINY_2B, check_fp32=False),
        CheckpointSpec("qwen2_vl_7b", TINY_7B, check_fp32=False),
    ),
    gemm_size=256,
    gemm_repeats=3,
    copy_bytes=16 << 20,
    copy_repeats=3,
    parity_tokens=4,
    decode_batches=(1, 8, 64),
    decode_steps=(2, 16),
    decode_repeats=2,
    decode_batch_cap_s=5.0,
    decode_prompt_tokens=8,
    kv_cache_memory_bytes=64 << 20,
    vit_images=((112, 112), (224, 112)),
    vit_repeats=1,
    vit_shape={"depth": 2, "embed_dim": 32, "num_heads": 4, "mlp_hidden_dim": 64, "out_dim": 96},
    vit_thumbnail=(56, 56),
    vit_thumbnail_batch=2,
    q3_vit_shape=TINY_Q3_VISION,
    q3_vit_image=(128, 96),
    compile_backend="aot_eager",
    q3_lm=CheckpointSpec("qwen3_vl_8b_lm", TINY_Q3_LM, check_fp32=False),
    compare_requests=4,
    compare_output_len=4,
    tp_prompts=4,  # the smoke checks that the section runs, not a throughput
    tp_tokens=8,
    gpu_tests_timeout_s=40.0,
    layer_ops_tokens=(3,),
    layer_ops_repeats=1,
    layer_ops_calls=1,
    layer_ops_shape={
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "num_layers": 2,
    },
    estimates_s={},
)
