"""Logprobs of sampled tokens: the log-softmax of the raw logits, batched for the rows that ask.

Two calls around `sample()`: `raw_logprobs` before it (the logits as the model produced them,
before penalties, bias, masks or temperature, as vLLM's default reports), `gather_logprobs`
after it (the sampled tokens' values and ranks), with one device-to-host copy for the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmserve.errors import RequestFailure
from mmserve.execution.sampler import SamplingRow
from mmserve.scheduling.outputs import Logprobs


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
    logprobs = torch.log_softmax(logits[row_idxs].float(), dim=-1)  # [num_wanting, vocab]
    top = torch.topk(logprobs, max(num_top), dim=-1)  # values, indices: [num_wanting, max K]
    return RawLogprobs(row_idxs, num_top, logprobs, top.values, top.indices)


def gather_logprobs(
    raw: RawLogprobs, tokens: Sequence[int | RequestFailure]
) -> dict[int, Logprobs]:
    """Each asking row's Logprobs (by row index) for the token sampled for it; rows that
    failed get none."""
    kept = [j for j, i in enumerate(raw.row_idxs) if not isinstance(tokens[i], RequestFailure)]
    if not kept:
        return {}
    device = raw.logprobs.device
    sampled = torch.tensor([tokens[raw.row_idxs[j]] for j in kept], device=device)[:, None]
    logprobs = raw.logprobs[kept]  # [num_kept, vocab]
    chosen = logprobs.gather(1, sampled)  # [num_kept, 1]
    ranks = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1  # [num_kept, 1]
    # one host copy: [values (1 + K) | ids (1 + K) | rank]; float64 holds every id exactly
    width = 1 + raw.top_values.shape[1]
    host = (
        torch.cat(
            [
                chosen.double(),
                raw.top_values[kept].double(),
                sampled.double(),
                raw.top_ids[kept].double(),
                ranks.double(),
            ],
            dim=1,
        )
        .cpu()
        .numpy()
    )
    out: dict[int, Logprobs] = {}
    for row, j in enumerate(kept):
        k = 1 + raw.num_top[j]
        out[raw.row_idxs[j]] = Logprobs(
            token_ids=host[row : row + 1, width : width + k].astype("int32"),
            logprobs=host[row : row + 1, :k].astype("float32"),
            ranks=host[row : row + 1, 2 * width].astype("int32"),
        )
    return out
