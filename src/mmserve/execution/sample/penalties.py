"""Presence, frequency and repetition penalties and logit_bias, batched on the logits' device.

vLLM's semantics: `logit_bias` adds to the named tokens' logits; `repetition_penalty` divides
the positive logits (multiplies the negative ones) of every token seen in the prompt or the
output; `frequency_penalty` subtracts penalty x count and `presence_penalty` subtracts the
penalty once, over the generated tokens only. Token counts are scattered each step from the
rows' token ids (no Python loop over the vocabulary, no host sync).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmserve.errors import FailureKind, RequestFailure
from mmserve.execution.host_copy import to_device
from mmserve.execution.sample.rows import SamplingRow


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> dict[int, RequestFailure]:
    """Apply each row's bias and penalties to `logits` ([num_rows, vocab] float32) in place.

    Returns the rows whose logit_bias names a token outside the vocabulary (validation checks
    this on entry; a row that slipped past it fails alone). Rows without penalties cost nothing.
    """
    penalized = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not penalized:
        return {}
    failures = _apply_logit_bias(logits, rows, penalized)
    counted = [
        i
        for i in penalized
        if i not in failures
        and (
            rows[i].params.presence_penalty
            or rows[i].params.frequency_penalty
            or rows[i].params.repetition_penalty != 1.0
        )
    ]
    if counted:
        index = to_device(counted, torch.long, logits.device)
        logits[index] = _penalized(logits[index], [rows[i] for i in counted])
    return failures


def _apply_logit_bias(
    logits: torch.Tensor, rows: Sequence[SamplingRow], penalized: list[int]
) -> dict[int, RequestFailure]:
    vocab_size = logits.shape[1]
    failures: dict[int, RequestFailure] = {}
    row_idx: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i in penalized:
        bias = rows[i].params.logit_bias
        if not bias:
            continue
        if not all(0 <= t < vocab_size for t in bias):
            failures[i] = RequestFailure(
                f"logit_bias names a token id outside the vocabulary [0, {vocab_size})",
                FailureKind.REQUEST,
                "logit_bias",
            )
            continue
        row_idx.extend([i] * len(bias))
        token_ids.extend(bias)
        biases.extend(bias.values())
    if row_idx:
        index = to_device([row_idx, token_ids], torch.long, logits.device)
        values = to_device(biases, torch.float32, logits.device)
        logits.index_put_((index[0], index[1]), values, accumulate=True)
    return failures


def _penalized(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """`logits` ([num_rows, vocab], a copy) with the rows' count-based penalties applied."""
    vocab_size, device = logits.shape[1], logits.device
    outputs = [_output_ids(row) for row in rows]
    output_counts = token_counts(outputs, vocab_size, device)  # [num_rows, vocab]
    repetition = [row.params.repetition_penalty for row in rows]
    if any(r != 1.0 for r in repetition):
        # prompt and output alike: every token the row holds
        seen = token_counts([row.token_ids for row in rows], vocab_size, device) > 0
        # NOTE: any penalty > 0 is valid, but float32 holds neither 1e-300 nor 1e300: the
        # factor is kept inside float32's range and a logit it sends past the largest float
        # is held there (+inf would make the row unsampleable: a client's value, not a bug).
        finfo = torch.finfo(logits.dtype)
        factors = [min(max(r, finfo.tiny), finfo.max) for r in repetition]
        scale = to_device(factors, torch.float32, device)[:, None]  # [num_rows, 1]
        penalized = torch.where(logits > 0, logits / scale, logits * scale)
        logits = torch.where(seen, penalized.clamp(max=finfo.max), logits)
    weights = [[row.params.frequency_penalty for row in rows]]
    weights.append([row.params.presence_penalty for row in rows])
    frequency, presence = to_device(weights, torch.float32, device)  # [num_rows] each
    return (
        logits
        - frequency[:, None] * output_counts
        - presence[:, None] * (output_counts > 0).to(logits.dtype)
    )


def token_counts(
    sequences: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """How often each token occurs in each sequence: [num_sequences, vocab_size] float32."""
    max_len = max((len(s) for s in sequences), default=0)
    counts = torch.zeros(len(sequences), vocab_size + 1, device=device)
    if max_len == 0:
        return counts[:, :vocab_size]
    # padded with vocab_size: a column that is dropped after the scatter
    padded = [list(s) + [vocab_size] * (max_len - len(s)) for s in sequences]
    ids = to_device(padded, torch.long, device).clamp_(0, vocab_size)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab_size]


def _output_ids(row: SamplingRow) -> Sequence[int]:
    num_prompt = len(row.token_ids) - row.num_output_tokens
    return row.token_ids[num_prompt:]
