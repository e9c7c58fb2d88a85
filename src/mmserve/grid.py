"""Vision grid arithmetic: the input patches and the merged tokens of a (t, h, w) patch grid."""

from __future__ import annotations

from collections.abc import Sequence


def grid_num_patches(grid_thw: Sequence[int]) -> int:
    """Input patches the vision tower reads for one item (what its activations scale with)."""
    t, h, w = grid_thw
    return t * h * w


def grid_num_tokens(grid_thw: Sequence[int], merge_size: int) -> int:
    """Embeddings (placeholder tokens) one item becomes: merge_size x merge_size patches each."""
    return grid_num_patches(grid_thw) // merge_size**2
