"""What the runner keeps per request between steps, and what the engine attaches for it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmserve.multimodal import MultiModalFeature
from mmserve.scheduling.outputs import RunnerPayload
from mmserve.updates import Logprobs


@dataclass(slots=True)
class RequestState:
    """The runner's copy of one running request."""

    request_id: str
    token_ids: list[int]  # prompt + every token generated so far
    mm_features: list[MultiModalFeature]
    block_ids: list[int]
    num_computed_tokens: int
    payload: RunnerPayload
    # blocks before this index came from the prefix cache (shared, written by others)
    first_own_block_idx: int = 0
    # prompt logprobs computed so far, chunk by chunk, until the first token is sampled; None
    # when the request did not ask or has sent them (a resumed request does not again)
    prompt_logprob_chunks: list[Logprobs] | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.payload.num_prompt_tokens

    def positions(self, start: int, end: int) -> np.ndarray:
        """M-RoPE positions [3, end - start] of token indices [start, end)."""
        p = self.payload
        num_prompt = p.num_prompt_tokens
        parts = []
        if start < num_prompt:
            parts.append(p.mrope_positions[:, start : min(end, num_prompt)])
        if end > num_prompt:
            first = max(start, num_prompt)
            row = np.arange(first, end, dtype=np.int64) + p.mrope_position_delta
            parts.append(row[None, :].repeat(3, axis=0))  # text: equal on all three axes
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
