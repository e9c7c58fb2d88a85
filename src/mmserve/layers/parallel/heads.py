"""Which attention heads a rank holds: query heads split evenly, KV heads split or replicated.

    heads 8, KV heads 2, size 2: rank r has query heads [4r, 4r + 4) and KV head r
    heads 8, KV heads 2, size 4: rank r has query heads [2r, 2r + 2) and KV head r * 2 // 4
                                 (each KV head on two ranks, which both cache it)

A rank's query heads always share the KV heads it holds: with size >= KV heads, a rank's
query heads lie inside one GQA group (the group of KV head `rank * kv_heads // size`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.layers.parallel.group import TPGroup


@dataclass(frozen=True)
class HeadSplit:
    """This rank's heads: `num_heads` query heads from `first_head`, `num_kv_heads` KV heads
    from `first_kv_head` (replicated on `kv_replicas` ranks each; 1 when split)."""

    num_heads: int
    first_head: int
    num_kv_heads: int
    first_kv_head: int
    kv_replicas: int


def split_heads(num_heads: int, num_kv_heads: int, tp: TPGroup) -> HeadSplit:
    """The rank's share; ValueError naming the numbers when the group cannot split them."""
    size = tp.size
    if num_heads % size:
        raise ValueError(
            f"tensor parallel size {size} must divide the number of attention heads ({num_heads})"
        )
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"tensor parallel size {size} must divide the number of KV heads ({num_kv_heads}) "
            "or be a multiple of it"
        )
    heads = num_heads // size
    if size <= num_kv_heads:
        kv_heads = num_kv_heads // size
        return HeadSplit(heads, tp.rank * heads, kv_heads, tp.rank * kv_heads, 1)
    first_kv_head = tp.rank * num_kv_heads // size
    return HeadSplit(heads, tp.rank * heads, 1, first_kv_head, size // num_kv_heads)


def split_evenly(total: int, tp: TPGroup, what: str) -> int:
    """This rank's share of `total` (a layer's width); ValueError naming `what` otherwise."""
    if total % tp.size:
        raise ValueError(f"tensor parallel size {tp.size} must divide the {what} ({total})")
    return total // tp.size
