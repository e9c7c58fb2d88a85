"""Paged attention against dense causal attention, for scattered block layouts and mixed batches."""

from __future__ import annotations

import random

import pytest
import torch

from mmserve.layers.attention import (
    MAX_SCORE_ELEMENTS,
    TorchAttentionBackend,
)
from tests.support.paged_attention import check_paged_equals_dense


@pytest.mark.parametrize(
    ("dtype", "atol"),
    [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)],
)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("max_score_elements", [MAX_SCORE_ELEMENTS, 100])
def test_paged_attention_equals_dense(
    dtype: torch.dtype, atol: float, seed: int, max_score_elements: int
) -> None:
    """max_score_elements=100 forces one query per SDPA call on the prefill path."""
    check_paged_equals_dense(dtype, atol, seed, max_score_elements, "cpu")


@pytest.mark.parametrize("head_dim", [24, 72])
def test_paged_attention_equals_dense_at_head_dims_that_are_not_powers_of_two(head_dim) -> None:
    check_paged_equals_dense(torch.float32, 1e-5, 2, MAX_SCORE_ELEMENTS, "cpu", head_dim)
    check_paged_equals_dense(torch.bfloat16, 3e-2, 3, 100, "cpu", head_dim)


def test_metadata_slots_follow_block_tables() -> None:
    meta = TorchAttentionBackend().build_metadata([2, 1], [6, 3], [[7, 2], [5]], block_size=4)
    # seq 0 writes positions 4, 5 -> block 2 offsets 0, 1; seq 1 writes position 2 of block 5
    assert meta.slot_mapping.tolist() == [8, 9, 22]
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert meta.block_tables.tolist() == [[7, 2], [5, 0]]
    assert meta.num_tokens == 3 and meta.query_lens == [2, 1]


def test_metadata_rejects_a_block_table_too_short() -> None:
    with pytest.raises(ValueError, match="fewer than seq_len=9"):
        TorchAttentionBackend().build_metadata([9], [9], [[0, 1]], block_size=4)


def test_decode_groups_cover_every_sequence_once_and_cut_only_where_padding_is_large() -> None:
    from mmserve.layers.attention import _decode_groups

    assert _decode_groups([]) == []
    # Equal lengths: nothing to gain from a cut.
    assert _decode_groups([5] * 10) == [list(range(10))]
    # Two clusters far apart: cut between them, each group sorted by length.
    lengths = [20, 2, 21, 3, 2, 20]
    groups = _decode_groups(lengths)
    assert sorted(map(sorted, groups)) == [[0, 2, 5], [1, 3, 4]]
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 70))]
        groups = _decode_groups(lengths)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
        assert padded <= len(lengths) * max(lengths)
