"""Fixtures of the model tests: each tiny checkpoint loaded once by mmserve and by transformers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from mmserve.models.config import ModelConfig
from mmserve.models.loader import load_model


@dataclass
class LoadedPair:
    model_dir: Path
    model: torch.nn.Module
    config: ModelConfig
    hf: torch.nn.Module  # the transformers model of the same checkpoint (the oracle)


@pytest.fixture(scope="session")
def loaded(tiny_checkpoint: Path) -> LoadedPair:
    import transformers

    model, config = load_model(tiny_checkpoint, dtype=torch.float32)
    hf_cls = getattr(transformers, config.architecture)
    hf = hf_cls.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    return LoadedPair(tiny_checkpoint, model, config, hf)
