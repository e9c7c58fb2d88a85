"""Metadata built into the persistent buffers equals metadata built fresh, for both backends,
and the buffers are reused step after step (no per-step tensor)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from mmserve.layers.attention import TorchAttentionBackend, write_kv_cache
from mmserve.layers.attention.buffers import AttentionBuffers, BatchLimits
from mmserve.layers.attention.torch_backend import TorchPlan

BLOCK_SIZE = 16
LIMITS = BatchLimits(max_num_tokens=256, max_num_seqs=16, max_blocks_per_seq=12)


def _backends() -> list:
    backends = [TorchAttentionBackend()]
    triton = pytest.importorskip("triton")
    if triton.knobs.runtime.interpret or torch.cuda.is_available():
        from mmserve.layers.attention.triton_backend import TritonAttentionBackend

        backends.append(TritonAttentionBackend())
    return backends


def _random_step(rng: random.Random) -> tuple[list[int], list[int], list[list[int]]]:
    """Decodes of assorted lengths, chunks and fresh prefills, scattered blocks."""
    query_lens, seq_lens, tables = [], [], []
    for _ in range(rng.randint(1, LIMITS.max_num_seqs)):
        q_len = 1 if rng.random() < 0.6 else rng.randint(2, 20)
        seq_len = q_len + rng.randint(0, 150)
        num_blocks = -(-seq_len // BLOCK_SIZE) + rng.randint(0, 1)
        query_lens.append(q_len)
        seq_lens.append(seq_len)
        tables.append(rng.sample(range(1, 400), num_blocks))
    return query_lens, seq_lens, tables


def _plain(plan) -> object:
    """A plan's values (tensors as lists) for comparison."""
    if isinstance(plan, TorchPlan):
        batches = [
            (b.seq_idx.tolist(), b.token_idx.tolist(), b.max_blocks) for b in plan.decode_batches
        ]
        return batches, plan.prefill_seq_idx
    return plan.tile_seq_idx.tolist(), plan.tile_q_start.tolist(), plan.num_tiles


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
def test_buffered_metadata_equals_fresh_metadata_and_reuses_the_buffers(backend) -> None:
    rng = random.Random(7)
    buffers = AttentionBuffers(LIMITS, "cpu")
    for _ in range(20):
        step = _random_step(rng)
        fresh = backend.build_metadata(*step, BLOCK_SIZE, "cpu")
        staged = backend.build_metadata(*step, BLOCK_SIZE, "cpu", buffers=buffers)
        for field in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
            want, got = getattr(fresh, field), getattr(staged, field)
            assert want.dtype == got.dtype and torch.equal(want, got), field
        assert staged.query_start_loc_cpu == fresh.query_start_loc_cpu
        assert staged.seq_lens_cpu == fresh.seq_lens_cpu
        assert _plain(staged.plan) == _plain(fresh.plan)
        # views of the one buffer, not new tensors
        assert staged.slot_mapping.data_ptr() == buffers.slot_mapping.host.data_ptr()
        assert staged.block_tables.data_ptr() == buffers.block_tables.host.data_ptr()


def test_the_layout_checks_still_refuse_a_bad_batch() -> None:
    buffers = AttentionBuffers(LIMITS, "cpu")
    backend = TorchAttentionBackend()
    with pytest.raises(ValueError, match="need 0 < query_len <= seq_len"):
        backend.build_metadata([3], [2], [[1]], BLOCK_SIZE, buffers=buffers)
    with pytest.raises(ValueError, match="fewer than seq_len=40"):
        backend.build_metadata([1], [40], [[1, 2]], BLOCK_SIZE, buffers=buffers)


def test_a_padding_slot_is_never_stored() -> None:
    kv_cache = torch.zeros(2, 4, BLOCK_SIZE, 2, 8)
    key = torch.ones(3, 2, 8)
    slots = torch.tensor([5, -1, 17])
    write_kv_cache(kv_cache, key, key, slots, skip_negative=True)
    flat = kv_cache[0].view(-1, 2, 8)
    assert flat[5].eq(1).all() and flat[17].eq(1).all()
    assert int(flat.ne(0).any(dim=(1, 2)).sum()) == 2  # the last slot (index -1) untouched
    # without the filter, -1 is the cache's last slot: a real block's
    write_kv_cache(kv_cache, key, key, slots)
    assert flat[-1].eq(1).all()


def test_the_torch_backend_skips_padding_rows_of_a_padded_batch() -> None:
    backend = TorchAttentionBackend()
    meta = backend.build_metadata([1, 1], [1, 5], [[2], [3]], BLOCK_SIZE)
    padded = dataclasses.replace(
        meta, slot_mapping=torch.tensor([-1, 3 * BLOCK_SIZE + 4]), has_padding=True
    )
    kv_cache = torch.zeros(2, 4, BLOCK_SIZE, 1, 8)
    q = torch.randn(2, 2, 8)
    kv = torch.randn(2, 1, 8)
    backend.forward(q, kv, kv, kv_cache, padded, 8**-0.5)
    flat = kv_cache[0].view(-1, 1, 8)
    assert torch.equal(flat[3 * BLOCK_SIZE + 4], kv[1])
    assert int(flat.ne(0).any(dim=(1, 2)).sum()) == 1
