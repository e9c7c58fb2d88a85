"""Prompt logprobs: the log-softmax at each prompt position, for the requests that ask.

Position p's logits predict prompt token p + 1, so a prompt of P tokens has P - 1 rows (the
first token has none; the last position's logits are the first sampled token's). A chunked
prefill computes its window's rows each step; the runner keeps them until the request samples
its first token and sends them all at once, in `Logprobs`' layout: column 0 the prompt token,
then the K most likely, and the prompt token's rank.

    prompt     t0   t1   t2   t3   t4        (P = 5)
    window     [ chunk 1 ][ chunk 2 ]
    rows       p0→t1 p1→t2 | p2→t3 p3→t4     p4's logits sample the first output token
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from mmserve.execution.request_state import RequestState
from mmserve.scheduling.outputs import SchedulerOutput
from mmserve.updates import Logprobs

ComputeLogits = Callable[[torch.Tensor], torch.Tensor]  # [n, hidden] -> [n, vocab]

# Rows of logits materialised at once: [rows, vocab] float32 (600 MB at Qwen2's vocab).
_MAX_ROWS_PER_SLICE = 1024


def add_window_rows(
    compute_logits: ComputeLogits,
    hidden: torch.Tensor,
    request_ids: Sequence[str],
    so: SchedulerOutput,
    states: Mapping[str, RequestState],
) -> None:
    """Add the rows that this step's windows cover to the requests that asked (only those:
    the others' prompt logits are never computed). `hidden` ([num_tokens, hidden]) holds
    the windows of `request_ids` back to back, in that order."""
    offset = 0
    for request_id in request_ids:
        num_tokens = so.num_scheduled_tokens[request_id]
        state = states[request_id]
        chunks = state.prompt_logprob_chunks
        # the window starts at num_computed_tokens, as in `input_batch.prepare_batch`
        start = state.num_computed_tokens
        last = min(start + num_tokens, state.payload.num_prompt_tokens - 1)
        if chunks is not None and last > start:
            rows = hidden[offset : offset + last - start]  # [last - start, hidden]
            targets = state.token_ids[start + 1 : last + 1]
            k = int(state.payload.sampling_params.prompt_logprobs or 0)
            chunks.append(prompt_logprob_rows(compute_logits, rows, targets, k))
        offset += num_tokens


def take_prompt_logprobs(compute_logits: ComputeLogits, state: RequestState) -> Logprobs | None:
    """The whole prompt's rows of a request that asked and has not had them; None else."""
    chunks = state.prompt_logprob_chunks
    if chunks is None:
        return None
    state.prompt_logprob_chunks = None
    if chunks:
        return join_rows(chunks)
    k = int(state.payload.sampling_params.prompt_logprobs or 0)  # a one-token prompt: no rows
    return prompt_logprob_rows(compute_logits, torch.zeros(0, 1), [], k)


def prompt_logprob_rows(
    compute_logits: ComputeLogits,
    hidden: torch.Tensor,
    target_ids: Sequence[int],
    num_top: int,
) -> Logprobs:
    """`hidden` ([n, hidden_size]): the hidden states of n prompt positions; `target_ids`:
    the prompt token after each. The n rows of `Logprobs` with the K = `num_top` most likely
    tokens, read back in one copy per slice."""
    n = hidden.shape[0]
    assert n == len(target_ids)
    parts: list[np.ndarray] = []
    for lo in range(0, n, _MAX_ROWS_PER_SLICE):
        hi = min(n, lo + _MAX_ROWS_PER_SLICE)
        logprobs = torch.log_softmax(compute_logits(hidden[lo:hi]).float(), dim=-1)  # [m, vocab]
        k = min(num_top, logprobs.shape[1])
        targets = torch.tensor(target_ids[lo:hi], dtype=torch.long, device=hidden.device)
        chosen = logprobs.gather(1, targets[:, None])  # [m, 1]
        ranks = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1  # [m, 1]
        top = torch.topk(logprobs, k, dim=-1)  # [m, k] each
        table = [chosen, top.values, targets[:, None], top.indices, ranks]
        parts.append(torch.cat([t.double() for t in table], dim=1).cpu().numpy())
    k = min(num_top, _vocab_or_k(parts, num_top))
    table = np.concatenate(parts) if parts else np.zeros((0, 2 * (1 + k) + 1))
    width = 1 + k
    return Logprobs(
        token_ids=table[:, width : 2 * width].astype(np.int32),
        logprobs=table[:, :width].astype(np.float32),
        ranks=table[:, 2 * width].astype(np.int32),
    )


def _vocab_or_k(parts: list[np.ndarray], num_top: int) -> int:
    """K as the tables were built (a vocabulary smaller than K caps it)."""
    if not parts:
        return num_top
    return (parts[0].shape[1] - 1) // 2 - 1


def join_rows(chunks: Sequence[Logprobs]) -> Logprobs:
    """One `Logprobs` of the chunks' rows in order (every chunk has the same K)."""
    if len(chunks) == 1:
        return chunks[0]
    return Logprobs(
        token_ids=np.concatenate([c.token_ids for c in chunks]),
        logprobs=np.concatenate([c.logprobs for c in chunks]),
        ranks=np.concatenate([c.ranks for c in chunks]),
    )
