"""The first tensor-parallel rank's sampled tokens, sent to the other ranks.

Only the first rank samples (its generator, seeds, penalties, grammar masks and logprobs are
the group's); the others take its tokens so that every rank's request states advance alike.
A row's outcome travels as one int64: the token id (>= 0), or a failure as -1 - its kind's
index, so the other ranks fail the same rows (and scrub the same KV blocks).

    rank 0   sample_step -> [t0, FAIL(internal), t2] -> encode [t0, -2, t2] ─ broadcast ─┐
    rank 1   [t0, RequestFailure(internal), t2] <- decode <─────────────────────────────┘
"""

from __future__ import annotations

import torch

from mmserve.errors import FailureKind, RequestFailure
from mmserve.layers.parallel import TPGroup

_KINDS = tuple(FailureKind)


def broadcast_tokens(
    tp: TPGroup,
    tokens: list[int | RequestFailure] | None,
    num_rows: int,
    device: torch.device,
) -> list[int | RequestFailure]:
    """On the first rank `tokens` (its samples, `num_rows` of them) are sent and returned as
    they are; on the others `tokens` is None and the first rank's outcomes come back, each
    failure with a message that names the first rank (theirs is the message that is sent)."""
    if tp.is_first:
        assert tokens is not None and len(tokens) == num_rows
        codes = [t if isinstance(t, int) else -1 - _KINDS.index(t.kind) for t in tokens]
        tp.broadcast(torch.tensor(codes, dtype=torch.int64, device=device), src=0)
        return tokens
    received = torch.empty(num_rows, dtype=torch.int64, device=device)  # [num_rows]
    tp.broadcast(received, src=0)
    return [
        code
        if code >= 0
        else RequestFailure("sampling failed on tensor-parallel rank 0", _KINDS[-1 - code])
        for code in received.tolist()
    ]
