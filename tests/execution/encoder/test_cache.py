"""EncoderCache: what it holds is on the model's device and dtype, counted, freed by name."""

from __future__ import annotations

import torch

from mmserve.execution.encoder.cache import EncoderCache


def test_put_converts_to_the_models_dtype_and_counts_its_bytes() -> None:
    cache = EncoderCache(torch.device("cpu"), torch.bfloat16)
    cache.put("a", torch.ones(3, 4, dtype=torch.float32))
    cache.put("b", torch.arange(8.0).reshape(4, 2).t())  # a transposed view: stored contiguous
    assert cache.get("a").dtype == torch.bfloat16 and cache.get("b").is_contiguous()
    assert torch.equal(cache.get("b").float(), torch.arange(8.0).reshape(4, 2).t())
    assert len(cache) == 2 and "a" in cache
    assert cache.num_bytes == (3 * 4 + 2 * 4) * 2


def test_free_drops_only_the_named_and_ignores_unknown_ones() -> None:
    cache = EncoderCache(torch.device("cpu"), torch.float32)
    cache.put("a", torch.zeros(1, 2))
    cache.put("b", torch.zeros(2, 2))
    cache.free(["a", "never-put"])
    assert "a" not in cache and cache.get("a") is None and "b" in cache
    assert cache.num_bytes == 2 * 2 * 4
