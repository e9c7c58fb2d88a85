"""Tensor parallelism: the group a layer's collectives run over, and the parallel layers."""

from mmserve.layers.parallel.group import SINGLE, TPGroup

__all__ = ["SINGLE", "TPGroup"]
