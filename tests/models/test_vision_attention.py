"""Vision tower pieces: segment attention and the Qwen2.5-VL window order."""

from __future__ import annotations

import pytest
import torch

from mmserve.models.qwen2_vl_vision import segment_attention, window_order


def _dense_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int]):
    outs, start = [], 0
    for n in seqlens:
        qs, ks, vs = (t[start : start + n].double() for t in (q, k, v))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * q.shape[-1] ** -0.5
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
        start += n
    return torch.cat(outs)


# Same-length segments apart (gathered) and back to back (read and written through views, as
# the images of one size in a batch are), each with and without query chunks.
@pytest.mark.parametrize("seqlens", [[8, 3, 8, 8, 17, 3, 1], [8, 8, 8, 3, 3]])
@pytest.mark.parametrize("max_score_elements", [1 << 28, 4 * 8 * 8 * 2, 50])
def test_segment_attention_is_exact_per_segment(
    seqlens: list[int], max_score_elements: int
) -> None:
    """Tokens attend within their own segment only, whatever the batching and chunking."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(seqlens), 4, 16) for _ in range(3))
    out = segment_attention(q, k, v, seqlens, 16**-0.5, max_score_elements)
    torch.testing.assert_close(out.double(), _dense_segments(q, k, v, seqlens), atol=1e-5, rtol=0)


def test_window_order_covers_every_token_once_window_by_window() -> None:
    # grid 1 x 10 x 14 patches -> 5 x 7 merged tokens, windows of 2 x 2 merged tokens
    index, seqlens = window_order([(1, 10, 14), (2, 4, 4)], merge=2, window_merged=2)
    assert sorted(index.tolist()) == list(range(5 * 7 + 2 * 2 * 2))
    assert sum(seqlens) == 4 * len(index)
    # first window of the first image: merged tokens (0,0) (0,1) (1,0) (1,1) of the 5x7 grid
    assert index[:4].tolist() == [0, 1, 7, 8]
    # the 5x7 grid tiles into 3 x 4 windows; the corner one holds a single merged token
    assert len(seqlens) == 12 + 2 and seqlens[11] == 4
    # the second item has two frames of one 2x2 window each
    assert seqlens[12:] == [16, 16]
