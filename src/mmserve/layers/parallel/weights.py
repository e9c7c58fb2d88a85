"""Where a rank's share of a parallel parameter comes from in the checkpoint.

A parallel layer says, for each of its parameters, which checkpoint tensors (or which slices
of them) fill it on this rank: a list of `WeightPart`s. The loader reads exactly those slices
(`safe_open(...).get_slice(name)[...]`) and nothing else; tests fill layers from in-memory
tensors through the same `copy_weight_part`.

A fused q/k/v on rank 1 of 2 (4 query heads, 2 KV heads, head_dim d), three parts:

    checkpoint q_proj.weight [4d, hidden]  rows [2d, 4d) -> qkv_proj.weight rows [0, 2d)
    checkpoint k_proj.weight [2d, hidden]  rows [ d, 2d) -> qkv_proj.weight rows [2d, 3d)
    checkpoint v_proj.weight [2d, hidden]  rows [ d, 2d) -> qkv_proj.weight rows [3d, 4d)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class WeightPart:
    """One checkpoint tensor's share of one parameter of a module, on this rank.

    `param` is the module's parameter ("weight", "bias"). `source` names the checkpoint tensor
    relative to the module's parent ("q_proj.weight" for a fused `qkv_proj` beside where
    `q_proj` was), or None for the module's own tensor of the same name. The checkpoint tensor
    has `full_shape`; this rank reads `[start, stop)` of it along `dim` (the whole tensor when
    `dim` is None) and writes it at `offset` along `dim` of the parameter.
    """

    param: str
    source: str | None
    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0
    offset: int = 0

    @property
    def num_elements(self) -> int:
        """How many of the parameter's elements this part fills."""
        numel = 1
        for axis, size in enumerate(self.full_shape):
            numel *= (self.stop - self.start) if axis == self.dim else size
        return numel

    def index(self) -> tuple[slice, ...]:
        """The slice of the checkpoint tensor this rank reads."""
        if self.dim is None:
            return ()
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)


@runtime_checkable
class HasWeightParts(Protocol):
    """A module whose parameters are filled from (slices of) checkpoint tensors."""

    def weight_parts(self) -> list[WeightPart]: ...


def copy_weight_part(
    param: torch.Tensor, part: WeightPart, read: Callable[[tuple[slice, ...]], torch.Tensor]
) -> None:
    """Copy `part` into `param`: `read(index)` returns the checkpoint tensor's slice there
    (a safetensors slice, or an in-memory tensor indexed). An empty slice reads nothing."""
    if part.dim is None:
        param.copy_(read(()))
        return
    length = part.stop - part.start
    if length <= 0:
        return
    param.narrow(part.dim, part.offset, length).copy_(read(part.index()))
