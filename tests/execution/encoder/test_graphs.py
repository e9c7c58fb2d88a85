"""Encoder CUDA graphs on the CPU: the ladder, padding into it, and the capture/replay flow with
the graph replaced by eager execution of the captured callable (same static buffers)."""

from __future__ import annotations

import pytest
import torch

from mmserve.execution.encoder.graphs import (
    GRAPH_FLOOR_PATCHES,
    MAX_GRAPH_FRAMES,
    EncoderGraphs,
    graph_budgets,
    make_encoder_embed,
    padded_shape,
    smallest_budget,
)
from mmserve.execution.graphs.capture import eager_graph_factory
from mmserve.models.config import VisionConfig
from mmserve.models.qwen2_vl_vision import VisionTransformer
from mmserve.processing.image_processor import smart_resize

VISION = {
    "qwen2_vl": {"model_type": "qwen2_vl", "mlp_hidden_dim": 64},
    "qwen2_5_vl": {
        "model_type": "qwen2_5_vl",
        "mlp_hidden_dim": 48,
        "hidden_act": "silu",
        "window_size": 56,  # 2 x 2 merged tokens: small images still have several windows
        "fullatt_block_indexes": (1,),
    },
}


def tiny_tower(arch: str, seed: int = 0) -> VisionTransformer:
    torch.manual_seed(seed)
    cfg = VisionConfig(depth=2, embed_dim=32, num_heads=4, out_dim=24, **VISION[arch])
    return VisionTransformer(cfg).eval()


def _graphs(tower: VisionTransformer, max_patches: int, floor: int = 64) -> EncoderGraphs:
    return EncoderGraphs(
        tower,
        lambda pixels, grids: list(tower(pixels, grids).split(_sizes(grids))),
        max_patches_per_call=max_patches,
        device=torch.device("cpu"),
        dtype=torch.float32,
        make_graph=eager_graph_factory,
        floor_patches=floor,
    )


def _sizes(grids) -> list[int]:
    return [t * h * w // 4 for t, h, w in grids]


def _pixels(tower: VisionTransformer, grids, seed: int) -> torch.Tensor:
    num_patches = sum(t * h * w for t, h, w in grids)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_patches, tower.config.patch_input_dim, generator=generator)


def test_the_ladder_doubles_from_the_floor_and_ends_at_the_max() -> None:
    assert graph_budgets(16384) == (256, 512, 1024, 2048, 4096, 8192, 16384)
    assert graph_budgets(5000) == (256, 512, 1024, 2048, 4096, 5000)
    assert graph_budgets(256) == (256,)
    assert graph_budgets(100) == (100,)  # a budget below the floor: one graph, the budget
    with pytest.raises(ValueError, match="max_patches >= 1"):
        graph_budgets(0)


def test_the_floor_is_a_224_pixel_image() -> None:
    """vLLM's 64-token floor for Qwen2.5-VL, in input patches of the processor's own resize."""
    h, w = smart_resize(224, 224, min_pixels=56 * 56, max_pixels=16384 * 28 * 28)
    num_patches = (h // 14) * (w // 14)
    assert num_patches == GRAPH_FLOOR_PATCHES and num_patches // 4 == 64


def test_a_call_pads_into_the_smallest_budget_that_fits() -> None:
    budgets = graph_budgets(5000)
    assert smallest_budget(budgets, 4) == 256
    assert smallest_budget(budgets, 256) == 256
    assert smallest_budget(budgets, 260) == 512
    assert smallest_budget(budgets, 4097) == 5000
    assert smallest_budget(budgets, 5001) is None
    assert padded_shape(1024, 4).num_frame_segments == MAX_GRAPH_FRAMES + 1
    assert padded_shape(16, 4).num_frame_segments == 4


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_replayed_embeddings_equal_the_unpadded_eager_tower(arch: str) -> None:
    tower = tiny_tower(arch)
    graphs = _graphs(tower, max_patches=1000)
    calls = [
        [(1, 8, 8)],  # exactly the floor: no padding
        [(1, 4, 6)],  # into the floor, mostly padding
        [(1, 6, 10), (2, 4, 4), (1, 2, 2)],  # several items, a two-frame clip, odd windows
        [(1, 10, 14), (1, 8, 8)],  # 204 patches: same budget as the first calls
        [(1, 16, 20)],  # 320 patches: the next budget up
        [(1, 20, 30), (1, 6, 6)],  # 636 -> the max (1000), not a power of two
    ]
    results = []
    with torch.inference_mode():
        for seed, grids in enumerate(calls):
            pixels = _pixels(tower, grids, seed)
            got = graphs(pixels, grids)
            want = tower(pixels, grids).split(_sizes(grids))
            assert [g.shape for g in got] == [w.shape for w in want]
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
            results.append((got, [w.clone() for w in want]))
    assert graphs.captured_budgets == (64, 128, 256, 512, 1000)
    assert graphs.num_replays == len(calls) and graphs.num_eager_calls == 0
    # every call's output was cloned out of the static buffers: later replays changed none
    for got, want in results:
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_padding_never_reaches_a_real_patch() -> None:
    """Garbage in the padding (a previous call's pixels, here huge values) changes nothing."""
    tower = tiny_tower("qwen2_5_vl", seed=3)
    graphs = _graphs(tower, max_patches=256)
    big = [(1, 16, 16)]
    small = [(1, 6, 8)]
    with torch.inference_mode():
        graphs(_pixels(tower, big, 0) * 1e3, big)
        got = graphs(_pixels(tower, small, 1), small)[0]
        want = tower(_pixels(tower, small, 1), small)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_calls_that_do_not_fit_run_eagerly() -> None:
    tower = tiny_tower("qwen2_vl")
    graphs = _graphs(tower, max_patches=512)
    too_big = [(1, 24, 24)]  # 576 patches > 512
    too_many = [(1, 2, 2)] * (MAX_GRAPH_FRAMES + 1)  # more frames than the graph has segments
    with torch.inference_mode():
        for grids in (too_big, too_many):
            pixels = _pixels(tower, grids, 0)
            got = torch.cat(graphs(pixels, grids))
            torch.testing.assert_close(got, tower(pixels, grids))
    assert graphs.num_eager_calls == 2 and graphs.captured_budgets == ()


def test_bad_inputs_are_refused_before_any_capture() -> None:
    tower = tiny_tower("qwen2_vl")
    graphs = _graphs(tower, max_patches=512)
    with pytest.raises(ValueError, match="expected"):
        graphs(torch.zeros(10, tower.config.patch_input_dim), [(1, 4, 4)])
    assert graphs.captured_budgets == ()


def test_the_flag_is_refused_without_cuda_and_off_under_enforce_eager() -> None:
    from torch import nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.visual = tiny_tower("qwen2_vl")

        def embed_multimodal(self, pixels, grids):
            return list(self.visual(pixels, grids).split(_sizes(grids)))

    model = Model()
    cpu = {"device": torch.device("cpu"), "dtype": torch.float32, "max_patches_per_call": 1024}
    embed, enabled = make_encoder_embed(
        model, enable_encoder_cuda_graph=False, enforce_eager=False, **cpu
    )
    assert not enabled and embed == model.embed_multimodal
    _, enabled = make_encoder_embed(
        model, enable_encoder_cuda_graph=True, enforce_eager=True, **cpu
    )
    assert not enabled
    with pytest.raises(ValueError, match="--enable-encoder-cuda-graph needs a CUDA device"):
        make_encoder_embed(model, enable_encoder_cuda_graph=True, enforce_eager=False, **cpu)
