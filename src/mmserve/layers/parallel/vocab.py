"""Vocab-parallel token embedding and LM head: each rank holds a contiguous range of the
vocabulary's rows (the vocabulary padded up to a multiple of the group's size).

    vocab 10, size 4: per rank 3 rows   rank 0 [0, 3)  1 [3, 6)  2 [6, 9)  3 [9, 10) + 2 padding

The embedding looks up the ids in its range (zeros elsewhere) and all-reduces: every rank then
holds every token's row. The LM head multiplies by its rows and all-gathers the logits: every
rank gets the full [n, vocab] (padding columns dropped), so any rank can sample.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.layers.parallel.group import TPGroup
from mmserve.layers.parallel.weights import WeightPart


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [vocab_start, vocab_start + rows_per_rank) of a [vocab_size, hidden]
    table; rows past vocab_size (padding) are zero. `weight` [rows_per_rank, hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size))
        nn.init.normal_(self.weight)  # nn.Embedding's (a checkpoint's rows replace it)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [n] -> [n, hidden], the full rows on every rank."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        is_mine = (local >= 0) & (local < self.rows_per_rank)
        embeds = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)
        embeds = embeds * is_mine.unsqueeze(-1).to(embeds.dtype)  # [n, hidden]
        return self.tp.all_reduce(embeds)

    def weight_parts(self) -> list[WeightPart]:
        stop = min(self.vocab_start + self.rows_per_rank, self.vocab_size)
        full = (self.vocab_size, self.hidden_size)
        return [WeightPart("weight", None, full, 0, self.vocab_start, stop)]


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, vocab-parallel like the embedding (a tied model has none: it
    computes its logits over the embedding's rows with `vocab_parallel_logits`)."""


def vocab_parallel_logits(
    hidden_states: torch.Tensor, table: VocabParallelEmbedding
) -> torch.Tensor:
    """hidden_states [n, hidden] -> logits [n, vocab_size] on every rank: this rank's columns,
    all-gathered, the padding columns dropped. At TP=1: hidden @ weight^T."""
    logits = hidden_states @ table.weight.t()  # [n, rows_per_rank]
    if table.tp.size == 1:
        return logits
    return table.tp.all_gather(logits, dim=-1)[:, : table.vocab_size]
