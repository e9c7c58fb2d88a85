"""Loading checkpoints: both tensor layouts, shards, tied embeddings, and precise failures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmserve.layers.attention import TorchAttentionBackend
from mmserve.models.kv_cache import allocate_kv_caches
from mmserve.models.loader import CheckpointError, load_model
from tests.support.factory import write_tiny_checkpoint


def _copy_with_tensors(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_transformers5_layout_and_shards_load_the_same(
    qwen2_5_vl_dir: Path, tmp_path: Path
) -> None:
    reference, _ = load_model(qwen2_5_vl_dir, dtype=torch.float32)
    tensors = load_file(str(qwen2_5_vl_dir / "model.safetensors"))
    renamed = {}
    for name, t in tensors.items():
        if name.startswith("visual."):
            name = "model." + name
        elif name.startswith("model."):
            name = "model.language_model." + name[len("model.") :]
        renamed[name] = t
    dst = tmp_path / "sharded"
    shutil.copytree(qwen2_5_vl_dir, dst)
    (dst / "model.safetensors").unlink()
    names = sorted(renamed)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: renamed[n] for n in shard_names}, str(dst / shard))
        weight_map.update(dict.fromkeys(shard_names, shard))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model, _ = load_model(dst, dtype=torch.float32)
    _same_parameters(model, reference)


def test_checkpoint_dtype_is_the_default_and_dtype_casts(qwen2_vl_dir: Path) -> None:
    model, config = load_model(qwen2_vl_dir)
    assert config.dtype == "float32"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    model16, _ = load_model(qwen2_vl_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in model16.parameters()} == {torch.bfloat16}


def test_wrong_shape_is_named(qwen2_vl_dir: Path, tmp_path: Path) -> None:
    tensors = load_file(str(qwen2_vl_dir / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.bias"] = torch.zeros(31)
    dst = _copy_with_tensors(qwen2_vl_dir, tmp_path / "bad", tensors)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias \[31\]"):
        load_model(dst)


def test_missing_tensor_is_named(qwen2_vl_dir: Path, tmp_path: Path) -> None:
    tensors = load_file(str(qwen2_vl_dir / "model.safetensors"))
    del tensors["visual.merger.ln_q.weight"]
    dst = _copy_with_tensors(qwen2_vl_dir, tmp_path / "bad", tensors)
    with pytest.raises(CheckpointError, match=r"missing tensors: visual\.merger\.ln_q\.weight"):
        load_model(dst)


def test_unexpected_tensor_is_named(qwen2_vl_dir: Path, tmp_path: Path) -> None:
    tensors = load_file(str(qwen2_vl_dir / "model.safetensors"))
    tensors["model.layers.7.mlp.gate_proj.weight"] = torch.zeros(2, 2)
    dst = _copy_with_tensors(qwen2_vl_dir, tmp_path / "bad", tensors)
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.7\.mlp"):
        load_model(dst)


def test_tied_embeddings_match_transformers(tmp_path: Path) -> None:
    import transformers

    ckpt = write_tiny_checkpoint(
        tmp_path / "tied", "qwen2_vl", seed=5, text={"tie_word_embeddings": True}
    )
    model, config = load_model(ckpt, dtype=torch.float32)
    assert config.tie_word_embeddings and model.lm_head is None
    hf = transformers.Qwen2VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
    ids = torch.tensor([5, 17, 33, 2, 99, 101, 7])
    positions = torch.arange(len(ids)).expand(3, -1)
    meta = TorchAttentionBackend().build_metadata([len(ids)], [len(ids)], [[1, 0]], block_size=4)
    kv = allocate_kv_caches(config, 2, 4, "cpu", torch.float32)
    with torch.inference_mode():
        ours = model.compute_logits(model(ids, positions, meta, kv))
        ref = hf.eval()(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_unknown_architecture_is_refused(qwen2_vl_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "llama"
    shutil.copytree(qwen2_vl_dir, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        load_model(dst)
