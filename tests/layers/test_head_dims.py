"""Head dims that are not powers of two (Qwen3-VL's vision 72, tiny models' 24) on the vision
paths: the SDPA reference is exact, and the flash (varlen) path takes what its kernel takes."""

from __future__ import annotations

import pytest
import torch

from mmserve.layers.attention.vision import has_varlen, segment_attention, varlen_takes_head_dim
from mmserve.models.config import VisionConfig
from mmserve.models.qwen2_vl_vision import VisionTransformer


def _dense_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int]):
    outs, start = [], 0
    for n in seqlens:
        qs, ks, vs = (t[start : start + n].double() for t in (q, k, v))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * q.shape[-1] ** -0.5
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("head_dim", [24, 72])
@pytest.mark.parametrize("max_score_elements", [1 << 28, 60])
def test_segment_attention_is_exact_at_any_head_dim(head_dim: int, max_score_elements: int):
    gen = torch.Generator().manual_seed(head_dim)
    seqlens = [16, 5, 16, 33, 1]
    q, k, v = torch.randn(3, sum(seqlens), 2, head_dim, generator=gen)
    out = segment_attention(q, k, v, seqlens, head_dim**-0.5, max_score_elements)
    torch.testing.assert_close(out.double(), _dense_segments(q, k, v, seqlens), atol=1e-5, rtol=0)


def test_varlen_takes_flash_attentions_head_dims() -> None:
    assert all(varlen_takes_head_dim(d) for d in (8, 24, 72, 80, 128, 256))
    assert not any(varlen_takes_head_dim(d) for d in (0, 4, 20, 36, 264, 512))
    # the CPU has no flash kernel, whatever the head dim
    assert not has_varlen("cpu", torch.bfloat16, 72)


def test_a_tower_asked_for_varlen_names_a_head_dim_flash_cannot_take() -> None:
    cfg = VisionConfig(
        model_type="qwen2_vl", depth=1, embed_dim=40, num_heads=2, mlp_hidden_dim=16, out_dim=8
    )
    tower = VisionTransformer(cfg, attention="varlen")
    with pytest.raises(ValueError, match="multiple of 8 up to 256.*head_dim 20"):
        tower.uses_varlen("cpu", torch.bfloat16)
    assert VisionTransformer(cfg).uses_varlen("cuda", torch.bfloat16) is False  # auto: reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("head_dim", [24, 72])
def test_varlen_matches_the_reference_on_cuda(head_dim: int) -> None:
    from mmserve.layers.attention.vision import make_segments, vision_attention

    assert has_varlen("cuda", torch.bfloat16, head_dim)
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    seqlens = [256, 16, 0, 4096, 5]
    q, k, v = torch.randn(3, sum(seqlens), 16, head_dim, device="cuda", generator=gen)
    segments = make_segments(seqlens, "cuda", max_seqlen=4096)
    scale = head_dim**-0.5
    got = vision_attention(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), segments, scale, use_varlen=True
    )
    want = segment_attention(q, k, v, seqlens, scale)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=0)


def _q3_shaped_tower(depth: int, embed_dim: int, num_heads: int) -> VisionTransformer:
    """Qwen3-VL's block recipe (patch 16, GELU-tanh MLP) at a head dim of embed / heads."""
    torch.manual_seed(0)
    cfg = VisionConfig(
        model_type="qwen2_vl",
        depth=depth,
        embed_dim=embed_dim,
        num_heads=num_heads,
        mlp_hidden_dim=2 * embed_dim,
        out_dim=64,
        patch_size=16,
        hidden_act="gelu_pytorch_tanh",
    )
    return VisionTransformer(cfg).eval()


def _graphs_match_eager(tower: VisionTransformer, device: torch.device, make_graph) -> None:
    from mmserve.execution.encoder.graphs import EncoderGraphs

    graphs = EncoderGraphs(
        tower,
        lambda pixels, grids: [tower(pixels, grids)],
        max_patches_per_call=1024,
        device=device,
        dtype=tower.patch_embed.proj.weight.dtype,
        make_graph=make_graph,
    )
    calls = [[(1, 16, 16)], [(1, 10, 14), (1, 4, 6)], [(2, 8, 12), (1, 20, 20)]]
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for grids in calls * 2:  # the second round replays the captured graphs
            n = sum(t * h * w for t, h, w in grids)
            pixels = torch.randn(n, tower.config.patch_input_dim, generator=gen).to(device)
            pixels = pixels.to(tower.patch_embed.proj.weight.dtype)
            want = tower(pixels, grids)
            got = torch.cat(graphs(pixels, grids))
            scale = want.float().abs().amax().item()
            torch.testing.assert_close(got.float(), want.float(), atol=0.02 * scale, rtol=0)
    assert graphs.num_eager_calls == 0 and graphs.num_replays == len(calls) * 2


def test_encoder_graphs_of_a_head_dim_72_tower_replay_as_eager() -> None:
    """The padded budgets and segments of the encoder graphs do not depend on the head dim
    (here the CPU's stand-in of a graph: capture runs the callable, replay reruns it)."""
    from mmserve.execution.graphs.capture import eager_graph_factory

    tower = _q3_shaped_tower(depth=2, embed_dim=144, num_heads=2)
    assert tower.config.head_dim == 72
    _graphs_match_eager(tower, torch.device("cpu"), eager_graph_factory)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_qwen3_vl_8b_shaped_tower_on_cuda_varlen_and_graphs() -> None:
    """Two blocks of Qwen3-VL-8B's tower (1152 wide, 16 heads of 72, patch 16): flash varlen
    against the SDPA reference, then its encoder CUDA graphs against the eager tower."""
    from mmserve.execution.graphs.capture import cuda_graph_factory

    device = torch.device("cuda")
    tower = _q3_shaped_tower(depth=2, embed_dim=1152, num_heads=16).to(device, torch.bfloat16)
    assert tower.uses_varlen(device, torch.bfloat16)
    reference = _q3_shaped_tower(depth=2, embed_dim=1152, num_heads=16)
    reference = reference.to(device, torch.bfloat16)
    reference.attention = "reference"
    grids = [(1, 64, 64), (1, 10, 14)]  # a 1024x1024 image at patch 16, and a small one
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, tower.config.patch_input_dim, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        want, got = reference(pixels, grids), tower(pixels, grids)
    scale = want.float().abs().amax().item()
    torch.testing.assert_close(got.float(), want.float(), atol=0.02 * scale, rtol=0)
    _graphs_match_eager(tower, device, cuda_graph_factory(device))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_qwen3_vl_tower_at_8b_width_on_varlen_matches_the_reference() -> None:
    """mmserve's Qwen3-VL tower, two blocks at Qwen3-VL-8B's width (16 heads of 72, patch 16,
    position table, a DeepStack level): flash varlen against the SDPA reference in bf16."""
    from mmserve.models.qwen3_vl_vision import Qwen3VisionTransformer

    cfg = VisionConfig(
        model_type="qwen3_vl",
        depth=2,
        embed_dim=1152,
        num_heads=16,
        mlp_hidden_dim=4304,
        out_dim=4096,
        patch_size=16,
        hidden_act="gelu_pytorch_tanh",
        deepstack_visual_indexes=(0,),
        num_position_embeddings=2304,
    )
    towers = []
    for attention in ("varlen", "reference"):
        torch.manual_seed(0)
        towers.append(Qwen3VisionTransformer(cfg, attention).to("cuda", torch.bfloat16).eval())
    fast, reference = towers
    grids = [(1, 64, 64), (1, 10, 14)]  # a 1024x1024 image at patch 16, and a small one
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, cfg.patch_input_dim, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        got, want = fast(pixels, grids), reference(pixels, grids)
    assert got.shape == (n // 4, 2 * 4096)
    scale = want.float().abs().amax().item()
    torch.testing.assert_close(got.float(), want.float(), atol=0.02 * scale, rtol=0)
