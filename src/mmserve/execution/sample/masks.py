"""allowed_token_ids and bad_words as logit masks, batched on the logits' device.

vLLM's semantics. `allowed_token_ids`: every other token's logit becomes -inf. `bad_words`
(tokenized by the front end into sequences, `SamplingParams.bad_words_token_ids`): a
sequence's last token is banned at this step when the output so far ends with the rest of the
sequence (a one-token word is banned always). Only the output counts, never the prompt, as in
vLLM. The host decides which (row, token) pairs to ban from the rows' token ids; the device
gets one write for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmserve.errors import FailureKind, RequestFailure
from mmserve.execution.host_copy import fill_cells_, to_device
from mmserve.execution.sample.rows import SamplingRow


def apply_token_masks(
    logits: torch.Tensor, rows: Sequence[SamplingRow]
) -> dict[int, RequestFailure]:
    """Mask each row's disallowed tokens in `logits` ([num_rows, vocab] float32) in place.

    Returns the rows whose allowed ids fall outside the vocabulary (validation refuses them
    on entry; a row that slipped past it fails alone). Rows without masks cost nothing.
    """
    masked = [i for i, row in enumerate(rows) if row.params.has_token_masks]
    if not masked:
        return {}
    vocab_size = logits.shape[1]
    failures: dict[int, RequestFailure] = {}
    allowed_rows = [i for i in masked if rows[i].params.allowed_token_ids is not None]
    keep_rows: list[int] = []
    keep_ids: list[int] = []
    for i in allowed_rows:
        ids = rows[i].params.allowed_token_ids or ()
        if not all(0 <= t < vocab_size for t in ids):
            failures[i] = RequestFailure(
                f"allowed_token_ids names a token id outside the vocabulary [0, {vocab_size})",
                FailureKind.REQUEST,
                "allowed_token_ids",
            )
            continue
        keep_rows.extend([i] * len(ids))
        keep_ids.extend(ids)
    allowed_rows = [i for i in allowed_rows if i not in failures]
    if allowed_rows:
        _keep_only(logits, allowed_rows, keep_rows, keep_ids)
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for i in masked:
        if i in failures:
            continue
        for token_id in banned_tokens(rows[i], vocab_size):
            ban_rows.append(i)
            ban_ids.append(token_id)
    if ban_rows:
        fill_cells_(logits, ban_rows, ban_ids, float("-inf"))
    return failures


def _keep_only(
    logits: torch.Tensor, row_idxs: list[int], keep_rows: list[int], keep_ids: list[int]
) -> None:
    """-inf everywhere in rows `row_idxs` except at the (row, id) pairs to keep."""
    device = logits.device
    keep = torch.zeros(logits.shape, dtype=torch.bool, device=device)  # [num_rows, vocab]
    fill_cells_(keep, keep_rows, keep_ids, True)
    in_rows = torch.zeros(logits.shape[0], dtype=torch.bool, device=device)
    in_rows.index_fill_(0, to_device(row_idxs, torch.long, device), True)  # no scalar copy
    logits.masked_fill_(in_rows[:, None] & ~keep, float("-inf"))


def banned_tokens(row: SamplingRow, vocab_size: int) -> list[int]:
    """The last tokens of the row's bad-word sequences that the output's tail completes."""
    sequences = row.params.bad_words_token_ids
    if not sequences:
        return []
    num_prompt = len(row.token_ids) - row.num_output_tokens
    output = row.token_ids[num_prompt:]
    out: list[int] = []
    for seq in sequences:
        prefix_len = len(seq) - 1
        if prefix_len > len(output) or not 0 <= seq[-1] < vocab_size:
            continue
        if prefix_len == 0 or list(output[len(output) - prefix_len :]) == list(seq[:-1]):
            out.append(seq[-1])
    return out
