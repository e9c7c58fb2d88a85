"""Load a Hugging Face model directory (safetensors, single file or sharded) into a model class.

Both checkpoint layouts map onto our parameter names:

    hub / transformers 4 save            transformers 5 in-memory names     ours
    visual.*                             model.visual.*                      visual.*
    model.*                              model.language_model.*              model.*
    lm_head.*                            lm_head.*                           lm_head.*

Every tensor is checked before any is copied: a missing, unexpected or wrongly shaped tensor
raises CheckpointError naming the tensors. A parallel layer names the checkpoint tensors (and
this rank's slices of them) it is made of (`layers/parallel/weights.py`): a fused q/k/v reads
q_proj, k_proj and v_proj; a tensor-parallel rank reads only its rows or columns.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from mmserve.layers.fused import LayerOps
from mmserve.layers.parallel import SINGLE, HasWeightParts, TPGroup, WeightPart, copy_weight_part
from mmserve.models.config import ModelConfig, load_model_config
from mmserve.models.qwen2_vl_vision import VisionTransformer
from mmserve.models.qwen3_vl_vision import Qwen3VisionTransformer
from mmserve.models.registry import get_model_class

_PREFIX_ALIASES = (("model.visual.", "visual."), ("model.language_model.", "model."))
_MAX_NAMES_IN_MESSAGE = 10


class CheckpointError(ValueError):
    """The checkpoint's files do not match the architecture its config.json names."""


def canonical_weight_name(name: str) -> str:
    """Our parameter name for a checkpoint tensor name, whichever layout wrote it."""
    for alias, ours in _PREFIX_ALIASES:
        if name.startswith(alias):
            return ours + name[len(alias) :]
    return name


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory: the shards of the index, or the one file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        raise CheckpointError(
            f"{model_dir} has neither model.safetensors nor model.safetensors.index.json; "
            "only safetensors checkpoints are supported"
        )
    for path in files:
        if not path.is_file():
            raise CheckpointError(
                f"shard {path.name} listed in the index is missing in {model_dir}"
            )
    return files


def _names(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:_MAX_NAMES_IN_MESSAGE])
    more = len(names) - _MAX_NAMES_IN_MESSAGE
    return shown + (f" (and {more} more)" if more > 0 else "")


Targets = dict[str, list[tuple[str, WeightPart]]]


def expected_tensors(model: nn.Module) -> Targets:
    """Each checkpoint tensor the model reads (our name for it) -> the (parameter, part) pairs
    it fills on this rank: a parallel layer's `weight_parts` (slices, fused tensors), else the
    parameter's own tensor, whole."""
    targets: Targets = {}
    owned: set[str] = set()
    for module_name, module in model.named_modules():
        if not isinstance(module, HasWeightParts):
            continue
        prefix = f"{module_name}." if module_name else ""
        parent = module_name.rpartition(".")[0]
        parent_prefix = f"{parent}." if parent else ""
        for part in module.weight_parts():
            param = prefix + part.param
            name = param if part.source is None else parent_prefix + part.source
            targets.setdefault(name, []).append((param, part))
            owned.add(param)
    for name, param in model.named_parameters():
        if name not in owned:
            targets[name] = [(name, WeightPart(name, None, tuple(param.shape)))]
    return targets


def _plan(
    files: list[Path], targets: Targets, tied: bool, prefix: str = ""
) -> dict[str, tuple[Path, str]]:
    """Map each expected tensor (our name) to (file, tensor name); raise on any mismatch.

    `prefix`: load only the tensors under it (e.g. "visual."), into a module whose parameter
    names lack it; every other tensor is skipped unread."""
    plan: dict[str, tuple[Path, str]] = {}
    unexpected: list[str] = []
    wrong_shape: list[str] = []
    duplicated: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = canonical_weight_name(key)
                if prefix:
                    if not name.startswith(prefix):
                        continue
                    name = name[len(prefix) :]
                if tied and name == "lm_head.weight":
                    continue  # a tied model reuses the embedding; an extra copy is harmless
                if name not in targets:
                    unexpected.append(key)
                    continue
                if name in plan:
                    duplicated.append(key)
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                expected = targets[name][0][1].full_shape
                if shape != expected:
                    wrong_shape.append(f"{key} {list(shape)} != expected {list(expected)}")
                plan[name] = (path, key)
    missing = [name for name in targets if name not in plan]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_names(unexpected)}")
    if wrong_shape:
        problems.append(f"tensors with a wrong shape: {_names(wrong_shape)}")
    if duplicated:
        problems.append(f"tensors stored twice: {_names(duplicated)}")
    if problems:
        raise CheckpointError("checkpoint does not match its config.json: " + "; ".join(problems))
    return plan


def load_weights(model: nn.Module, model_dir: Path, tied: bool, prefix: str = "") -> None:
    """Copy every checkpoint tensor (under `prefix`) into `model`, cast to the parameter's dtype:
    on a tensor-parallel rank only its slices are read (`get_slice`), never a whole shard."""
    params = dict(model.named_parameters())
    targets = expected_tensors(model)
    plan = _plan(checkpoint_files(model_dir), targets, tied, prefix)
    filled = dict.fromkeys(params, 0)
    for parts in targets.values():
        for param, part in parts:
            filled[param] += part.num_elements
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, (path, key) in plan.items():
        by_file.setdefault(path, []).append((name, key))
    with torch.no_grad():
        for name, count in filled.items():
            if count < params[name].numel():  # vocabulary padding rows: zeros
                params[name].zero_()
        for path, entries in by_file.items():
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name, key in entries:
                    read = _reader(f, key)
                    for param, part in targets[name]:
                        copy_weight_part(params[param], part, read)


def _reader(f: Any, key: str) -> Callable[[tuple[slice, ...]], torch.Tensor]:
    """Reads tensor `key` of an open safetensors file: the whole of it, or only a slice."""
    sliced = f.get_slice(key)
    return lambda index: sliced[index] if index else f.get_tensor(key)


def _checkpoint_dtype(config: ModelConfig) -> torch.dtype:
    dtype = getattr(torch, config.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"config.json dtype {config.dtype!r} is not a torch dtype")
    return dtype


def load_model(
    model_dir: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    layer_ops: LayerOps | None = None,
    *,
    tp: TPGroup = SINGLE,
    shard_vision: bool = False,
) -> tuple[nn.Module, ModelConfig]:
    """Build the model `config.json` names and load its weights; returns (model, config).

    `dtype` defaults to the checkpoint's own dtype; `layer_ops` (the decoder's norms, SwiGLU
    and rotary) to the torch reference. The model is in eval mode with gradients
    off; parameters are created on the meta device first, so nothing is initialised twice.

    `tp`: this rank's group: the model holds this rank's shard (the vision tower's too with
    `shard_vision`, else the whole tower) and only those slices are read from the files.
    ValueError naming the numbers when the group cannot split the model's heads or widths.
    """
    path = Path(model_dir)
    config = load_model_config(path)
    dtype = dtype if dtype is not None else _checkpoint_dtype(config)
    model_cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = model_cls(config, layer_ops, tp, shard_vision)
    model = model.to(dtype=dtype).to_empty(device=device)
    load_weights(model, path, config.tie_word_embeddings)
    model.eval().requires_grad_(False)
    return model, config


VISION_PREFIX = "visual."


def load_vision_tower(
    model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> tuple[VisionTransformer | Qwen3VisionTransformer, ModelConfig]:
    """Build the vision tower alone and load only its `visual.*` tensors (what `mmserve
    encode` runs): the language model's weights are never read, nor memory made for them."""
    path = Path(model_dir)
    config = load_model_config(path)
    dtype = dtype if dtype is not None else _checkpoint_dtype(config)
    tower_cls = (
        Qwen3VisionTransformer if config.vision.model_type == "qwen3_vl" else VisionTransformer
    )
    with torch.device("meta"):
        tower = tower_cls(config.vision)
    tower = tower.to(dtype=dtype).to_empty(device=device)
    load_weights(tower, path, tied=False, prefix=VISION_PREFIX)
    tower.eval().requires_grad_(False)
    return tower, config
