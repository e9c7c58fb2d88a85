"""The engine's logprob arrays as vLLM's offline shape: per token, {token_id: Logprob}."""

from __future__ import annotations

from mmserve.engine.frontend.detokenizer import DecodeFn
from mmserve.engine.frontend.outputs import Logprob, TokenLogprobs
from mmserve.updates import Logprobs


def decode_logprobs(lp: Logprobs, decode: DecodeFn) -> tuple[list[TokenLogprobs], float]:
    """One dict per token (the sampled token first, then the top K in rank order; a sampled
    token among the top K appears once), and the sum of the sampled tokens' logprobs."""
    ids, values, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
    out: list[TokenLogprobs] = []
    total = 0.0
    for row_ids, row_values, rank in zip(ids, values, ranks, strict=True):
        entry: TokenLogprobs = {row_ids[0]: Logprob(row_values[0], rank, _text(row_ids[0], decode))}
        for k, (token_id, value) in enumerate(zip(row_ids[1:], row_values[1:], strict=True)):
            if token_id not in entry:
                entry[token_id] = Logprob(value, k + 1, _text(token_id, decode))
        out.append(entry)
        total += row_values[0]
    return out, total


def _text(token_id: int, decode: DecodeFn) -> str:
    # special tokens shown: a logprob entry names the token, whatever the output's text skips
    return decode([token_id], False)
