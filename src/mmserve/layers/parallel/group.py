"""TPGroup: this process's place in a tensor-parallel group, and the group's collectives.

Every parallel layer takes its group as a constructor argument (no global state): `SINGLE`
(rank 0 of 1) makes every collective the identity, so a model built with it is the plain
single-device model and never touches torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """`rank` of `size` in `group` (a torch.distributed ProcessGroup; None when size is 1).

    `rank` and `size` are this group's, not the world's: a data-parallel replica of a
    tensor-parallel model has its own group, ranks 0..size-1 within it.
    """

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.size):
            raise ValueError(f"TP rank {self.rank} outside a group of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"a TP group of {self.size} needs its torch.distributed group")

    @property
    def is_first(self) -> bool:
        """Rank 0: the rank that samples and answers the executor."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group, in place (returned for chaining)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` (the same shape on each) concatenated along `dim`, rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`x` of rank `src` (a group rank) on every rank, in place."""
        if self.size > 1:
            dist.broadcast(x, src=dist.get_global_rank(self.group, src), group=self.group)
        return x


SINGLE = TPGroup()
