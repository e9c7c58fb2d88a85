"""Megatron-style parallel linears: column-parallel (outputs split, no communication) and
row-parallel (inputs split, one all-reduce), with fused q/k/v and gate/up as column-parallel
layers of several blocks.

    x (replicated) -> ColumnParallel -> this rank's outputs -> RowParallel -> all_reduce -> y

A fused layer is ONE matmul on every rank, also at TP=1 (one [q|k|v] or [gate|up] weight made
at load time from the checkpoint's separate tensors: `weight_parts`). At TP=1 each layer is
exactly `F.linear(x, weight, bias)`, the op `nn.Linear` runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.layers.parallel.group import TPGroup
from mmserve.layers.parallel.heads import HeadSplit, split_evenly
from mmserve.layers.parallel.weights import WeightPart


def init_like_linear(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    """nn.Linear's initialisation (a layer built without a checkpoint, e.g. a benchmark's
    tower, computes with finite values; on the meta device it costs nothing)."""
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        weight.uniform_(-bound, bound)  # = kaiming_uniform_(a=sqrt(5)), nn.Linear's choice
        if bias is not None:
            bias.uniform_(-bound, bound)


@dataclass(frozen=True)
class OutputBlock:
    """One block of a column-parallel layer's outputs, as the checkpoint stores it: `size`
    outputs in the tensor of sibling module `source` ("q_proj"), or in the module's own tensor
    when `source` is None (blocks stacked in order, e.g. a ViT's [q|k|v]); this rank keeps
    outputs `[start, start + length)` of the block."""

    source: str | None
    size: int
    start: int
    length: int


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b for this rank's outputs only: each of `blocks`' kept outputs, concatenated
    in order. The input is replicated; the output is this rank's share (no communication).

    weight [sum(block.length), in_features], bias [sum(block.length)].
    """

    def __init__(
        self, in_features: int, blocks: Sequence[OutputBlock], *, bias: bool, tp: TPGroup
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.blocks = tuple(blocks)
        self.tp = tp
        out_features = sum(block.length for block in self.blocks)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        init_like_linear(self.weight, self.bias, in_features)

    @classmethod
    def split(
        cls, in_features: int, out_features: int, *, bias: bool, tp: TPGroup, what: str
    ) -> ColumnParallelLinear:
        """`out_features` split evenly (ValueError naming `what` if the size does not divide)."""
        return cls.merged(in_features, [out_features], [None], bias=bias, tp=tp, what=what)

    @classmethod
    def merged(
        cls,
        in_features: int,
        sizes: Sequence[int],
        sources: Sequence[str | None],
        *,
        bias: bool,
        tp: TPGroup,
        what: str,
    ) -> ColumnParallelLinear:
        """Several blocks (gate and up), each split evenly: this rank's [gate_r | up_r]."""
        blocks = []
        for size, source in zip(sizes, sources, strict=True):
            length = split_evenly(size, tp, what)
            blocks.append(OutputBlock(source, size, tp.rank * length, length))
        return cls(in_features, blocks, bias=bias, tp=tp)

    @classmethod
    def qkv(
        cls,
        in_features: int,
        head_dim: int,
        heads: HeadSplit,
        total_heads: tuple[int, int],
        sources: tuple[str, str, str] | None,
        *,
        bias: bool,
        tp: TPGroup,
    ) -> ColumnParallelLinear:
        """[q | k | v] of this rank's heads (`heads`, out of `total_heads` = (query heads, KV
        heads)); `sources` the checkpoint's three projections, or None for one stacked tensor."""
        num_heads, num_kv_heads = total_heads
        names = sources or (None, None, None)
        kv_size, kv_start = num_kv_heads * head_dim, heads.first_kv_head * head_dim
        kv_length = heads.num_kv_heads * head_dim
        q_size, q_start = num_heads * head_dim, heads.first_head * head_dim
        q_length = heads.num_heads * head_dim
        blocks = [
            OutputBlock(names[0], q_size, q_start, q_length),
            OutputBlock(names[1], kv_size, kv_start, kv_length),
            OutputBlock(names[2], kv_size, kv_start, kv_length),
        ]
        return cls(in_features, blocks, bias=bias, tp=tp)

    @property
    def output_sizes(self) -> list[int]:
        """This rank's outputs per block (how to split the output: q, k, v or gate, up)."""
        return [block.length for block in self.blocks]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_parts(self) -> list[WeightPart]:
        own_size = sum(block.size for block in self.blocks if block.source is None)
        params = [("weight", (self.in_features,))] + (
            [("bias", ())] if self.bias is not None else []
        )
        parts = []
        for param, tail in params:
            own_offset = offset = 0  # block start in the own tensor; in this rank's parameter
            for block in self.blocks:
                if block.source is None:
                    source, full, start = None, (own_size, *tail), own_offset + block.start
                    own_offset += block.size
                else:
                    source, full, start = (
                        f"{block.source}.{param}",
                        (block.size, *tail),
                        block.start,
                    )
                parts.append(
                    WeightPart(param, source, full, 0, start, start + block.length, offset)
                )
                offset += block.length
        return parts


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b: this rank's share of the inputs (a ColumnParallel's output)
    times its columns of W, summed over the group; the bias is added once, after the sum.

    weight [out_features, in_features / size], bias [out_features] (replicated).
    """

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool, tp: TPGroup, what: str
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features  # the whole layer's
        self.out_features = out_features
        local = split_evenly(in_features, tp, what)
        self.weight = nn.Parameter(torch.empty(out_features, local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        init_like_linear(self.weight, self.bias, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def weight_parts(self) -> list[WeightPart]:
        local = self.weight.shape[1]
        start = self.tp.rank * local
        full = (self.out_features, self.in_features)
        parts = [WeightPart("weight", None, full, 1, start, start + local)]
        if self.bias is not None:
            parts.append(WeightPart("bias", None, (self.out_features,)))
        return parts
