"""Apply packed grammar bitmasks to a batch of logits, on the logits' device, in one pass."""

from __future__ import annotations

import numpy as np
import torch

from mmserve.scheduling.outputs import GrammarOutput


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place.

    logits: [num_rows, vocab] float; bitmask: [num_rows, num_words] int32 where bit j of word w
    allows token 32 * w + j (an all-ones row, -1 in every word, changes nothing). The mask may
    be wider than the vocabulary (the last word's high bits are ignored) or narrower (tokens
    past 32 * num_words are disallowed: a padded vocabulary's ids no tokenizer produces).
    """
    num_rows, vocab = logits.shape
    assert bitmask.dtype == torch.int32 and bitmask.shape[0] == num_rows, bitmask.shape
    if logits.device.type == "cuda" and bitmask.device.type == "cpu":
        bitmask = bitmask.pin_memory()  # else the copy waits for the forward (host_copy.py)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    # an arithmetic shift keeps the sign bit of word -1, but & 1 reads one bit either way
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [num_rows, num_words, 32]
    allowed = bits.view(num_rows, -1).bool()  # [num_rows, 32 * num_words]
    num_covered = min(vocab, allowed.shape[1])
    if num_covered < vocab:
        pad = torch.zeros(num_rows, vocab - num_covered, dtype=torch.bool, device=logits.device)
        allowed = torch.cat([allowed[:, :num_covered], pad], dim=1)
    else:
        allowed = allowed[:, :vocab]
    logits.masked_fill_(~allowed, float("-inf"))


def sampling_bitmask(grammar: GrammarOutput | None, request_ids: list[str]) -> torch.Tensor | None:
    """The bitmask of the step's sampling rows, in their order: a structured request's row
    from `grammar`, all ones for every other row. None when no row has a grammar."""
    if grammar is None:
        return None
    index = {request_id: i for i, request_id in enumerate(grammar.request_ids)}
    picks = [index.get(r, -1) for r in request_ids]
    if all(i < 0 for i in picks):
        return None
    num_words = grammar.bitmask.shape[1]
    rows = np.full((len(request_ids), num_words), -1, dtype=np.int32)  # [num_rows, num_words]
    for row, i in enumerate(picks):
        if i >= 0:
            rows[row] = grammar.bitmask[i]
    return torch.from_numpy(rows)
