"""A tensor-parallel rank's load: it reads exactly the elements it holds; its parameters have
the slice shapes and hold the right slices of the checkpoint's tensors; impossible head counts
are refused naming the numbers; the KV cache and its cost per block count only the rank's KV
heads.

Loading needs no collectives, so a rank is built here with a stand-in group object."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mmserve.layers.parallel import TPGroup
from mmserve.models import loader
from mmserve.models.config import load_model_config
from mmserve.models.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block
from mmserve.models.loader import load_model
from tests.support.factory import write_tiny_checkpoint


def _rank(rank: int, size: int) -> TPGroup:
    return TPGroup(rank=rank, size=size, group=object())


def _rows(t: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    n = t.shape[0] // parts
    return t[part * n : (part + 1) * n]


def test_a_rank_holds_its_slices_of_the_decoder(qwen2_vl_dir: Path) -> None:
    full = load_file(str(qwen2_vl_dir / "model.safetensors"))
    model, config = load_model(qwen2_vl_dir, dtype=torch.float32, tp=_rank(1, 2))
    text, layer = config.text, "model.layers.1."
    head_dim = text.head_dim
    attn = model.model.layers[1].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    q, k, v = (full[f"{layer}self_attn.{p}_proj.weight"] for p in "qkv")
    assert attn.qkv_proj.weight.shape == (4 * head_dim, text.hidden_size)  # 2 q + 1 k + 1 v
    expected = torch.cat([_rows(q, 1, 2), _rows(k, 1, 2), _rows(v, 1, 2)])
    assert torch.equal(attn.qkv_proj.weight, expected)
    bias = torch.cat([_rows(full[f"{layer}self_attn.{p}_proj.bias"], 1, 2) for p in "qkv"])
    assert torch.equal(attn.qkv_proj.bias, bias)
    o = full[f"{layer}self_attn.o_proj.weight"]
    assert torch.equal(attn.o_proj.weight, o[:, o.shape[1] // 2 :])
    mlp = model.model.layers[1].mlp
    gate, up = full[f"{layer}mlp.gate_proj.weight"], full[f"{layer}mlp.up_proj.weight"]
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([_rows(gate, 1, 2), _rows(up, 1, 2)]))
    down = full[f"{layer}mlp.down_proj.weight"]
    assert torch.equal(mlp.down_proj.weight, down[:, down.shape[1] // 2 :])
    vocab = text.vocab_size
    assert torch.equal(
        model.model.embed_tokens.weight, full["model.embed_tokens.weight"][vocab // 2 :]
    )
    assert torch.equal(model.lm_head.weight, full["lm_head.weight"][vocab // 2 :])
    # the vision tower is whole on every rank unless asked to shard it
    assert torch.equal(
        model.visual.blocks[0].attn.qkv.weight, full["visual.blocks.0.attn.qkv.weight"]
    )


def test_a_rank_holds_its_slices_of_a_sharded_tower(qwen2_5_vl_dir: Path) -> None:
    full = load_file(str(qwen2_5_vl_dir / "model.safetensors"))
    model, config = load_model(
        qwen2_5_vl_dir, dtype=torch.float32, tp=_rank(0, 2), shard_vision=True
    )
    block = model.visual.blocks[2]
    qkv = full["visual.blocks.2.attn.qkv.weight"]  # stacked [q|k|v], each of 4 heads
    assert torch.equal(block.attn.qkv.weight, torch.cat([_rows(p, 0, 2) for p in qkv.chunk(3)]))
    proj = full["visual.blocks.2.attn.proj.weight"]
    assert torch.equal(block.attn.proj.weight, proj[:, : proj.shape[1] // 2])
    assert torch.equal(block.attn.proj.bias, full["visual.blocks.2.attn.proj.bias"])  # once
    gate = full["visual.blocks.2.mlp.gate_proj.weight"]
    assert torch.equal(block.mlp.gate_proj.weight, _rows(gate, 0, 2))
    merger = full["visual.merger.mlp.0.weight"]
    assert torch.equal(model.visual.merger.mlp[0].weight, merger)  # the merger stays whole


def test_kv_heads_replicated_past_their_count(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(
        tmp_path / "heads8",
        "qwen3_vl",
        seed=2,
        text={"num_attention_heads": 8, "num_key_value_heads": 2},
    )
    full = load_file(str(ckpt / "model.safetensors"))
    name = "model.language_model.layers.0.self_attn.{}_proj.weight"
    for rank, kv_head in ((1, 0), (2, 1), (3, 1)):
        model, config = load_model(ckpt, dtype=torch.float32, tp=_rank(rank, 4))
        attn = model.model.layers[0].self_attn
        head_dim = config.text.head_dim
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        k_rows = full[name.format("k")][kv_head * head_dim : (kv_head + 1) * head_dim]
        assert torch.equal(attn.qkv_proj.weight[2 * head_dim : 3 * head_dim], k_rows)
        assert torch.equal(
            attn.qkv_proj.weight[: 2 * head_dim], _rows(full[name.format("q")], rank, 4)
        )


def test_impossible_head_counts_are_refused_by_the_loader(
    qwen2_vl_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"size 3 must divide the number of attention heads \(4\)"):
        load_model(qwen2_vl_dir, tp=_rank(0, 3))
    narrow = write_tiny_checkpoint(
        tmp_path / "vision2", "qwen2_vl", seed=1, vision={"num_heads": 2, "embed_dim": 32}
    )
    load_model(narrow, tp=_rank(0, 4))  # a whole tower: its heads need not split
    with pytest.raises(ValueError, match=r"size 4 must divide the vision attention heads \(2\)"):
        load_model(narrow, tp=_rank(0, 4), shard_vision=True)


def test_the_kv_cache_holds_the_ranks_kv_heads(qwen2_vl_dir: Path) -> None:
    config = load_model_config(qwen2_vl_dir)  # 4 heads, 2 KV heads, head_dim 16, 2 layers
    one = kv_cache_bytes_per_block(config, 16, torch.float32)
    assert one == 2 * 16 * 2 * 16 * 4 * 2
    assert kv_cache_bytes_per_block(config, 16, torch.float32, _rank(1, 2)) == one // 2
    assert kv_cache_bytes_per_block(config, 16, torch.float32, _rank(3, 4)) == one // 2  # 1 head
    caches = allocate_kv_caches(config, 3, 16, "cpu", torch.float32, _rank(1, 2))
    assert [tuple(c.shape) for c in caches] == [(2, 3, 16, 1, 16)] * 2


class _CountingFile:
    """A safetensors file that counts the elements read from it (`reads`), whole or sliced."""

    def __init__(self, opened: Any, reads: list[int]) -> None:
        self.opened, self.reads = opened, reads

    def __enter__(self) -> _CountingFile:
        self.file = self.opened.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.opened.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.file.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        tensor = self.file.get_tensor(key)
        self.reads.append(tensor.numel())
        return tensor

    def get_slice(self, key: str) -> _CountingSlice:
        return _CountingSlice(self.file.get_slice(key), self.reads)


class _CountingSlice:
    def __init__(self, sliced: Any, reads: list[int]) -> None:
        self.sliced, self.reads = sliced, reads

    def get_shape(self) -> list[int]:
        return self.sliced.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self.sliced[index]
        self.reads.append(tensor.numel())
        return tensor


def test_a_rank_reads_exactly_the_elements_it_holds(
    qwen2_vl_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[int] = []
    monkeypatch.setattr(
        loader,
        "safe_open",
        lambda *args, **kwargs: _CountingFile(safe_open(*args, **kwargs), reads),
    )
    model, _ = load_model(qwen2_vl_dir, dtype=torch.float32, tp=_rank(1, 2))
    held = sum(p.numel() for p in model.parameters())
    in_files = sum(t.numel() for t in load_file(str(qwen2_vl_dir / "model.safetensors")).values())
    whole_tower = sum(p.numel() for p in model.visual.parameters())
    assert sum(reads) == held  # its slices, each once, and the replicated tensors whole
    assert held - whole_tower < (in_files - whole_tower) * 0.6  # about half of the decoder
