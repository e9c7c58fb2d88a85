"""Logprobs of sampled tokens: the log-softmax of the raw logits, batched for the rows that ask.

`raw_logprobs` runs before sampling (the logits as the model produced them, before penalties,
bias, masks or temperature, as vLLM's default reports); `logprob_table` after it, on the
device, from the device's picks, so that `step.py` reads it back in the step's one
copy; `unpack_logprobs` turns that copy into each row's `Logprobs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.errors import RequestFailure
from mmserve.execution.host_copy import to_device
from mmserve.execution.sample.rows import SamplingRow
from mmserve.updates import Logprobs


@dataclass(frozen=True)
class RawLogprobs:
    """The rows of one step that want logprobs, before their tokens are sampled."""

    row_idxs: list[int]  # indices into the step's sampling rows
    num_top: list[int]  # each row's K
    logprobs: torch.Tensor  # [num_wanting, vocab] float32
    top_values: torch.Tensor  # [num_wanting, max K] float32
    top_ids: torch.Tensor  # [num_wanting, max K] int64


def raw_logprobs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> RawLogprobs | None:
    """Log-softmax and top-K of the rows that asked for logprobs; None when none did."""
    row_idxs = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not row_idxs:
        return None
    vocab_size = logits.shape[1]
    num_top = [min(int(rows[i].params.logprobs or 0), vocab_size) for i in row_idxs]
    # a new tensor: sample() may then edit `logits` in place without touching these values
    index = to_device(row_idxs, torch.long, logits.device)  # a list index would sync
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)  # [num_wanting, vocab]
    top = torch.topk(logprobs, max(num_top), dim=-1)  # values, indices: [num_wanting, max K]
    return RawLogprobs(row_idxs, num_top, logprobs, top.values, top.indices)


def logprob_table(raw: RawLogprobs, tokens: torch.Tensor) -> torch.Tensor:
    """Every asking row's values for its sampled token, on the device: tokens [num_rows] int64
    (the step's picks, still on the device) -> [num_wanting, 2 * (1 + max K) + 1] float64:
    [chosen value, top K values | chosen id, top K ids | rank]; float64 holds every id exactly.
    """
    index = to_device(raw.row_idxs, torch.long, tokens.device)
    sampled = tokens[index][:, None]  # [num_wanting, 1]
    chosen = raw.logprobs.gather(1, sampled)  # [num_wanting, 1]
    ranks = (raw.logprobs > chosen).sum(dim=-1, keepdim=True) + 1  # [num_wanting, 1]
    parts = [chosen, raw.top_values, sampled, raw.top_ids, ranks]
    return torch.cat([p.double() for p in parts], dim=1)


def unpack_logprobs(
    raw: RawLogprobs, table: np.ndarray, tokens: Sequence[int | RequestFailure]
) -> dict[int, Logprobs]:
    """Each asking row's Logprobs (by row index) from the host copy of `logprob_table`; rows
    that failed get none."""
    width = 1 + raw.top_values.shape[1]
    out: dict[int, Logprobs] = {}
    for j, i in enumerate(raw.row_idxs):
        if isinstance(tokens[i], RequestFailure):
            continue
        k = 1 + raw.num_top[j]
        out[i] = Logprobs(
            token_ids=table[j : j + 1, width : width + k].astype("int32"),
            logprobs=table[j : j + 1, :k].astype("float32"),
            ranks=table[j : j + 1, 2 * width].astype("int32"),
        )
    return out


def gather_logprobs(
    raw: RawLogprobs, tokens: Sequence[int | RequestFailure]
) -> dict[int, Logprobs]:
    """`unpack_logprobs` for tokens already on the host (a failed row's pick counts as 0)."""
    picks = [0 if isinstance(t, RequestFailure) else t for t in tokens]
    device = raw.logprobs.device
    table = logprob_table(raw, torch.tensor(picks, dtype=torch.long, device=device))
    return unpack_logprobs(raw, table.cpu().numpy(), tokens)
