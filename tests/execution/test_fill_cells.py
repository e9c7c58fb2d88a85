"""`fill_cells_`: the sampler's sync-free scatter of one value into (row, column) cells."""

from __future__ import annotations

import torch

from mmserve.execution.host_copy import fill_cells_


def test_fills_exactly_the_named_cells_of_a_contiguous_and_a_strided_matrix() -> None:
    rows, cols = [0, 2, 2, 1], [3, 0, 4, 3]
    for matrix in (torch.zeros(3, 5), torch.zeros(5, 3).t()):
        want = matrix.clone()
        for r, c in zip(rows, cols, strict=True):
            want[r, c] = float("-inf")
        fill_cells_(matrix, rows, cols, float("-inf"))
        assert torch.equal(matrix, want)
    flags = torch.zeros(2, 4, dtype=torch.bool)
    fill_cells_(flags, [1], [2], True)
    assert flags.nonzero().tolist() == [[1, 2]]
