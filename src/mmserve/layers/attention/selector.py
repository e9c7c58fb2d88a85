"""`--attention-backend`: which backend attends, chosen once at start-up."""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from mmserve.layers.attention.backend import AttentionBackend
from mmserve.layers.attention.torch_backend import TorchAttentionBackend

INTERPRET_ENV = "TRITON_INTERPRET"

logger = logging.getLogger(__name__)


def select_backend(
    name: str,
    device: torch.device | str,
    *,
    block_size: int | None = None,
    head_dim: int | None = None,
) -> AttentionBackend:
    """auto: triton on CUDA, torch elsewhere. `triton` on a CPU runs Triton's interpreter and
    is allowed only when TRITON_INTERPRET=1 is set (a test and debugging aid: it is slow).
    `block_size` and the language model's `head_dim`, when given, are checked against what the
    backend supports, at start-up (the torch backend takes any)."""
    device_type = torch.device(device).type
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        name = "triton" if device_type == "cuda" and has_triton else "torch"
        if device_type == "cuda" and not has_triton:
            logger.warning(
                "attention on CUDA falls back to torch SDPA: the `triton` package is missing "
                "(pip install 'triton>=3.4')"
            )
        if name == "triton" and head_dim is not None and not _triton_takes(head_dim):
            logger.warning(
                "attention on CUDA falls back to torch SDPA: the triton kernels do not take "
                "head_dim %d",
                head_dim,
            )
            name = "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name != "triton":
        raise ValueError(f"--attention-backend must be auto, torch or triton, got {name!r}")
    if not has_triton:
        raise ValueError(
            "--attention-backend triton needs the `triton` package (pip install 'triton>=3.4'), "
            "or use --attention-backend torch"
        )
    is_interpreted = os.environ.get(INTERPRET_ENV, "0") == "1"
    if device_type != "cuda" and not is_interpreted:
        raise ValueError(
            f"--attention-backend triton runs on CUDA devices; on {device_type} it needs "
            f"{INTERPRET_ENV}=1 (Triton's interpreter, slow: for tests), "
            "or use --attention-backend torch"
        )
    from mmserve.layers.attention.triton_backend import (
        TritonAttentionBackend,
        check_block_size,
        check_head_dim,
    )

    if block_size is not None:
        check_block_size(block_size)
    if head_dim is not None:
        check_head_dim(head_dim)
    return TritonAttentionBackend()


def _triton_takes(head_dim: int) -> bool:
    from mmserve.layers.attention.triton_backend import takes_head_dim

    return takes_head_dim(head_dim)
