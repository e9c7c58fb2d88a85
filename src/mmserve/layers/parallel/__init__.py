"""Tensor parallelism: the group a layer's collectives run over, and the parallel layers."""

from mmserve.layers.parallel.group import SINGLE, TPGroup
from mmserve.layers.parallel.heads import HeadSplit, split_evenly, split_heads
from mmserve.layers.parallel.linear import ColumnParallelLinear, OutputBlock, RowParallelLinear
from mmserve.layers.parallel.vocab import (
    ParallelLMHead,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from mmserve.layers.parallel.weights import HasWeightParts, WeightPart, copy_weight_part

__all__ = [
    "SINGLE",
    "ColumnParallelLinear",
    "HasWeightParts",
    "HeadSplit",
    "OutputBlock",
    "ParallelLMHead",
    "RowParallelLinear",
    "TPGroup",
    "VocabParallelEmbedding",
    "WeightPart",
    "copy_weight_part",
    "split_evenly",
    "split_heads",
    "vocab_parallel_logits",
]
