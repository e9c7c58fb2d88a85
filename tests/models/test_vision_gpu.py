"""The vision tower's CUDA fast path: varlen attention against the SDPA reference, and encoder
CUDA graphs against the eager tower, in bfloat16, for both architectures."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.execution.encoder.graphs import EncoderGraphs
from mmserve.execution.graphs.capture import cuda_graph_factory
from mmserve.layers.attention.vision import (
    has_varlen,
    make_segments,
    segment_attention,
    vision_attention,
)
from mmserve.models.config import VisionConfig
from mmserve.models.qwen2_vl_vision import VisionTransformer
from tests.support.factory import random_image

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# The 7B tower's block shape (head dim 80), two blocks deep: real kernels, seconds to run.
SHAPES = {
    "qwen2_vl": {"model_type": "qwen2_vl", "mlp_hidden_dim": 5120},
    "qwen2_5_vl": {
        "model_type": "qwen2_5_vl",
        "mlp_hidden_dim": 3420,
        "hidden_act": "silu",
        "window_size": 112,
        "fullatt_block_indexes": (1,),
    },
}
CALLS = [
    [(1, 16, 16)],  # a 224x224 image: the floor, no padding
    [(1, 10, 14), (1, 4, 6)],  # two small images, padded
    [(1, 74, 74)],  # a 1036x1036 image (5476 patches)
    [(2, 20, 30), (1, 8, 8)],  # a clip of two frames and an image
]


def _tower(arch: str, attention: str = "auto") -> VisionTransformer:
    torch.manual_seed(0)
    cfg = VisionConfig(depth=2, embed_dim=1280, num_heads=16, out_dim=3584, **SHAPES[arch])
    return VisionTransformer(cfg, attention=attention).to("cuda", torch.bfloat16).eval()


def _pixels(cfg: VisionConfig, grids, seed: int) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, cfg.patch_input_dim, device="cuda", generator=g).to(torch.bfloat16)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 through two blocks: within 2% of the output's scale, element by element."""
    scale = want.float().abs().amax().item()
    torch.testing.assert_close(got.float(), want.float(), atol=0.02 * scale, rtol=0)


def test_varlen_runs_here() -> None:
    assert has_varlen("cuda", torch.bfloat16), f"torch {torch.__version__} lacks varlen_attn"


def test_varlen_attention_matches_the_reference_with_empty_segments() -> None:
    torch.manual_seed(0)
    seqlens = [256, 16, 0, 5476, 64, 4, 0, 0]
    q, k, v = torch.randn(3, sum(seqlens), 16, 80, device="cuda", dtype=torch.bfloat16)
    segments = make_segments(seqlens, "cuda", max_seqlen=8192)
    got = vision_attention(q, k, v, segments, 80**-0.5, use_varlen=True)
    want = segment_attention(q.float(), k.float(), v.float(), seqlens, 80**-0.5)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_the_tower_on_varlen_matches_the_reference_path(arch: str) -> None:
    fast, ref = _tower(arch, "varlen"), _tower(arch, "reference")
    with torch.inference_mode():
        for seed, grids in enumerate(CALLS):
            pixels = _pixels(fast.config, grids, seed)
            _close(fast(pixels, grids), ref(pixels, grids))


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_graph_replays_match_the_eager_tower(arch: str) -> None:
    tower = _tower(arch)
    device = torch.device("cuda")
    graphs = EncoderGraphs(
        tower,
        lambda pixels, grids: [tower(pixels, grids)],
        max_patches_per_call=8192,
        device=device,
        dtype=torch.bfloat16,
        make_graph=cuda_graph_factory(device),
    )
    with torch.inference_mode():
        for seed, grids in enumerate(CALLS * 2):  # the second round replays captured graphs
            pixels = _pixels(tower.config, grids, seed)
            got = torch.cat(graphs(pixels, grids))
            _close(got, tower(pixels, grids))
    assert graphs.num_eager_calls == 0 and graphs.num_replays == 2 * len(CALLS)
    assert graphs.captured_budgets == (256, 2048, 8192)


def test_the_engine_with_encoder_graphs_answers_as_without(qwen2_5_vl_dir) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    img = "<|vision_start|><|image_pad|><|vision_end|>"
    prompts = [
        {"prompt": f"{img}What is it?", "multi_modal_data": {"image": random_image(112, 84, 4)}},
        {"prompt": f"{img}And this?", "multi_modal_data": {"image": random_image(224, 224, 5)}},
    ]
    answers = []
    for enabled in (False, True):
        with LLM(
            model=str(qwen2_5_vl_dir),
            device="cuda",
            dtype="bfloat16",
            enable_encoder_cuda_graph=enabled,
        ) as llm:
            assert llm.config.encoder_cuda_graph is enabled
            answers.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert answers[0] == answers[1]
