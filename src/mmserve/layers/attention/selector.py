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
    name: str, device: torch.device | str, *, block_size: int | None = None
) -> AttentionBackend:
    """auto: triton on CUDA, torch elsewhere. `triton` on a CPU runs Triton's interpreter and
    is allowed only when TRITON_INTERPRET=1 is set (a test and debugging aid: it is slow).
    `block_size`, when given, is checked against what the backend supports, at start-up."""
    device_type = torch.device(device).type
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        name = "triton" if device_type == "cuda" and has_triton else "torch"
        if device_type == "cuda" and not has_triton:
            logger.warning(
                "attention on CUDA falls back to torch SDPA: the `triton` package is missing "
                "(pip install 'triton>=3.4')"
            )
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
    from mmserve.layers.attention.triton_backend import TritonAttentionBackend, check_block_size

    if block_size is not None:
        check_block_size(block_size)
    return TritonAttentionBackend()
