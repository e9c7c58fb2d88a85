"""The ViT's per-call metadata: exact and padded layouts, and the attention paths that read it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmserve.layers.attention.vision import (
    has_varlen,
    make_segments,
    segment_attention,
    vision_attention,
)
from mmserve.models.config import VisionConfig
from mmserve.models.qwen2_vl_vision import VisionTransformer
from mmserve.models.vision_metadata import (
    PaddedShape,
    build_vision_metadata,
    vision_hw_positions,
    window_order,
    window_patches,
)

GRIDS = [(1, 6, 10), (2, 4, 4), (1, 2, 2)]  # 60 + 32 + 4 = 96 patches, 4 frames
WINDOWED = VisionConfig(
    model_type="qwen2_5_vl",
    depth=2,
    embed_dim=32,
    num_heads=4,
    mlp_hidden_dim=48,
    out_dim=24,
    window_size=56,
    fullatt_block_indexes=(1,),
)
PLAIN = VisionConfig(
    model_type="qwen2_vl", depth=2, embed_dim=32, num_heads=4, mlp_hidden_dim=64, out_dim=24
)


def _bounds(segments) -> list[int]:
    return segments.cu_seqlens.tolist()


def test_exact_metadata_lists_frames_and_windows_in_order() -> None:
    meta = build_vision_metadata(GRIDS, WINDOWED, "cpu")
    assert meta.full.seqlens == (60, 16, 16, 4) and meta.full.max_seqlen == 60
    index, windows = window_order(GRIDS, 2, 2)
    assert meta.windowed.seqlens == tuple(windows) and meta.windowed.max_seqlen == 16
    assert _bounds(meta.windowed)[-1] == 96
    assert torch.equal(meta.window_index, index)
    assert torch.equal(meta.window_index[meta.window_inverse], torch.arange(24))
    # positions come in the blocks' (window) order, whole 2x2 groups moved together
    plain = vision_hw_positions(GRIDS, 2, "cpu").view(-1, 4, 2)
    assert torch.equal(meta.positions, plain[index].view(-1, 2))
    qwen2 = build_vision_metadata(GRIDS, PLAIN, "cpu")
    assert qwen2.windowed is qwen2.full and qwen2.window_index is None


def test_padded_metadata_keeps_padding_in_segments_of_its_own() -> None:
    shape = PaddedShape(num_patches=256, num_frame_segments=8)
    meta = build_vision_metadata(GRIDS, WINDOWED, "cpu", padded=shape)
    # frames, then the 160 padding patches as one segment, then empty slots
    assert _bounds(meta.full) == [0, 60, 76, 92, 96, 256, 256, 256, 256]
    assert meta.full.max_seqlen == 256
    # windows: the real ones, then padding in window-sized chunks, then empty slots up to 64
    exact = build_vision_metadata(GRIDS, WINDOWED, "cpu")
    real = _bounds(exact.windowed)
    bounds = _bounds(meta.windowed)
    assert len(bounds) == 256 // 4 + 1 and bounds[: len(real)] == real
    chunks = [b - a for a, b in zip(bounds[len(real) - 1 :], bounds[len(real) :], strict=False)]
    assert sum(chunks) == 160 and max(chunks) == window_patches(WINDOWED) == 16
    assert meta.windowed.max_seqlen == 16
    # padding merged tokens stay at the end, in place; real ones keep the exact permutation
    assert torch.equal(meta.window_index[:24], exact.window_index)
    assert torch.equal(meta.window_index[24:], torch.arange(24, 64))
    assert meta.num_patches == 256 and not meta.positions[96:].any()


def test_a_layout_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        build_vision_metadata(GRIDS, PLAIN, "cpu", padded=PaddedShape(64, 8))
    with pytest.raises(ValueError, match="do not fit"):  # 4 frames + padding > 4 segments
        build_vision_metadata(GRIDS, PLAIN, "cpu", padded=PaddedShape(256, 4))
    assert (
        _bounds(build_vision_metadata(GRIDS, PLAIN, "cpu", padded=PaddedShape(96, 4)).full)[-1]
        == 96
    )
    with pytest.raises(ValueError, match="max_seqlen 3 is below"):
        make_segments([4], "cpu", max_seqlen=3)


def test_segments_without_a_host_copy_are_read_from_cu_seqlens() -> None:
    torch.manual_seed(0)
    seqlens = [8, 0, 3, 8, 1, 0]
    q, k, v = (torch.randn(20, 2, 8) for _ in range(3))
    segments = make_segments(seqlens, "cpu", num_segments=9, keep_host_copy=False)
    assert segments.seqlens is None and segments.host_seqlens() == seqlens + [0, 0, 0]
    got = vision_attention(q, k, v, segments, 8**-0.5, use_varlen=False)
    torch.testing.assert_close(got, segment_attention(q, k, v, seqlens, 8**-0.5))


def test_varlen_is_cuda_and_half_precision_only() -> None:
    assert not has_varlen("cpu", torch.bfloat16)
    assert not has_varlen("cuda", torch.float32)
    tower = VisionTransformer(PLAIN, attention="varlen")
    with pytest.raises(ValueError, match="varlen vision attention needs CUDA"):
        tower(torch.zeros(4, PLAIN.patch_input_dim), [(1, 2, 2)])
    with pytest.raises(ValueError, match="vision attention must be one of"):
        VisionTransformer(PLAIN, attention="flash")
    assert not VisionTransformer(PLAIN).uses_varlen("cpu", torch.float32)


@pytest.mark.parametrize("config", [PLAIN, WINDOWED], ids=["qwen2_vl", "qwen2_5_vl"])
def test_the_varlen_forward_reads_no_host_value(config: VisionConfig) -> None:
    """The CUDA path's data flow, on the meta device (varlen_attn has a meta kernel, no CPU
    one): shapes and this torch's varlen_attn signature check out, and a host read
    (`.tolist()`, `.item()`: what a CUDA graph cannot capture) would raise here."""
    shape = PaddedShape(num_patches=256, num_frame_segments=8)
    meta = build_vision_metadata(GRIDS, config, "meta", use_varlen=True, padded=shape)
    meta = dataclasses.replace(
        meta,
        full=dataclasses.replace(meta.full, seqlens=None),
        windowed=dataclasses.replace(meta.windowed, seqlens=None),
    )
    with torch.device("meta"):
        tower = VisionTransformer(config).to(torch.bfloat16)
        pixels = torch.empty(256, config.patch_input_dim, dtype=torch.bfloat16)
    out = tower.encode(pixels, meta)
    assert out.shape == (64, config.out_dim) and out.dtype == torch.bfloat16
