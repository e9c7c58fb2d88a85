"""What the sampler knows of one request in a step: a `SamplingRow`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mmserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one request in this step."""

    request_id: str
    params: SamplingParams
    # tokens generated before this step: for min_tokens, and the position a seeded row's
    # noise is keyed by
    num_output_tokens: int
    eos_token_ids: tuple[int, ...]
    # prompt + tokens generated so far: read only by the penalties of a row that has them
    token_ids: Sequence[int] = ()
