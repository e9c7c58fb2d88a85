"""Activation functions by their Hugging Face config name."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x), the same floats with one temporary instead of three (a ViT's MLP
    activations are its largest: ~2x faster on a CPU)."""
    return (x * 1.702).sigmoid_().mul_(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": gelu_tanh,
    "quick_gelu": quick_gelu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a config's `hidden_act` names; ValueError naming the known ones otherwise."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unsupported hidden_act {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}"
        ) from None
