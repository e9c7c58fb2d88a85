"""Fixtures of the model tests: each tiny checkpoint loaded once by mmserve and by transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmserve.models.loader import load_model
from tests.support.oracle import LoadedPair


@pytest.fixture(scope="session")
def loaded(tiny_checkpoint: Path) -> LoadedPair:
    import transformers

    model, config = load_model(tiny_checkpoint, dtype=torch.float32)
    hf_cls = getattr(transformers, config.architecture)
    hf = hf_cls.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    return LoadedPair(tiny_checkpoint, model, config, hf)
