"""The embedding dtypes the pool protocol names (`protocol.EmbeddingDType`), as torch dtypes."""

from __future__ import annotations

from typing import get_args

import torch

from mmserve.disaggregation.protocol import EmbeddingDType

TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in get_args(EmbeddingDType)
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}
