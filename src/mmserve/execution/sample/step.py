"""The sampling of one step: raw logprobs, the device draw, and the step's one host copy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmserve.errors import RequestFailure
from mmserve.execution.sample.logprobs import logprob_table, raw_logprobs, unpack_logprobs
from mmserve.execution.sample.rows import SamplingRow
from mmserve.execution.sample.sampler import resolve_draw, sample_on_device
from mmserve.updates import Logprobs


@dataclass(frozen=True)
class StepSamples:
    tokens: list[int | RequestFailure]  # one per sampling row
    logprobs: dict[int, Logprobs]  # by row index, for the rows that asked and did not fail


def sample_step(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    generator: torch.Generator,
    token_bitmask: torch.Tensor | None,
) -> StepSamples:
    """Sample every row of `logits` ([num_rows, vocab]) and gather the logprobs of the rows
    that ask, reading the device back once: tokens, flags and logprob values in one copy."""
    raw = raw_logprobs(logits, rows)  # before the sampler edits the logits in place
    draw = sample_on_device(logits, rows, generator, token_bitmask=token_bitmask)
    flags = draw.host_flags()  # [3, num_rows] int64
    if raw is None:
        return StepSamples(resolve_draw(draw, flags.tolist(), rows), {})
    table = logprob_table(raw, draw.tokens)  # [num_wanting, width] float64
    # one copy: the flags ride as float64 (exact: token ids and 0/1 flags are small integers)
    both = torch.cat([flags.double().reshape(-1), table.reshape(-1)]).cpu().numpy()
    num_flags = flags.numel()
    tokens = resolve_draw(draw, both[:num_flags].astype("int64").reshape(3, -1).tolist(), rows)
    logprobs = unpack_logprobs(raw, both[num_flags:].reshape(table.shape), tokens)
    return StepSamples(tokens, logprobs)
