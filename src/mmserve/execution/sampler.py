"""Token sampling for one step: penalties and bias, greedy, temperature, top-k, top-p, seeds.

A row that cannot be sampled (parameters that slipped past validation, NaN or +inf logits, a
failing draw) gets a `RequestFailure` instead of a token; the other rows are unaffected.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmserve.errors import FailureKind, InvalidRequestError, RequestFailure
from mmserve.execution.penalties import apply_penalties
from mmserve.execution.token_bitmask import apply_token_bitmask_
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# What torch.Generator.manual_seed accepts: any signed or unsigned 64-bit integer.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Dividing float32 logits by less than this underflows the divisor to 0 (and 0/0 is NaN).
_MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one request in this step."""

    request_id: str
    params: SamplingParams
    generator: torch.Generator | None  # a per-request generator when params.seed is set
    num_output_tokens: int  # tokens generated before this step (for min_tokens)
    eos_token_ids: tuple[int, ...]
    # prompt + tokens generated so far: read only by the penalties of a row that has them
    token_ids: Sequence[int] = ()


def sample(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    default_generator: torch.Generator,
    *,
    token_bitmask: torch.Tensor | None = None,
) -> list[int | RequestFailure]:
    """Pick one token per row of `logits` ([num_rows, vocab], any float dtype).

    Greedy rows take one batched argmax; unseeded random rows of equal parameters one batched
    draw. A seeded row is sampled alone with its own generator, so a seeded request draws the
    same tokens whatever else shares its batch. `token_bitmask` ([num_rows, ceil(vocab / 32)]
    int32, structured output) disallows tokens per row; -1 words allow everything.
    """
    assert logits.shape[0] == len(rows)
    num_rows = len(rows)
    logits = logits.float()
    failures = _apply_min_tokens(logits, rows)
    failures.update(apply_penalties(logits, rows))  # nothing to do unless a row has some
    if token_bitmask is not None:
        apply_token_bitmask_(logits, token_bitmask)
    # One pass over the logits gives the greedy picks and, since max propagates NaN and +inf,
    # which rows are broken (-inf alone is fine: that token just cannot be drawn).
    best = logits.max(dim=-1)  # values, indices: [num_rows] each
    # one device-to-host copy for both: [num_rows finite flags, num_rows argmax tokens]
    host = torch.cat([torch.isfinite(best.values).to(torch.long), best.indices]).tolist()
    out: list[int | RequestFailure | None] = [None] * num_rows
    # unseeded random rows with the same parameters: one batched draw (a seeded row draws
    # alone, from its own generator, so that its tokens never depend on its batchmates)
    shared: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        if not host[i]:
            out[i] = _non_finite(row)
        elif i in failures:
            out[i] = failures[i]
        elif row.params.is_greedy:
            out[i] = host[num_rows + i]
        elif row.generator is None and _check_params(row.params) is None:
            p = row.params
            shared.setdefault((p.temperature, p.effective_top_k, p.top_p), []).append(i)
        else:
            out[i] = _sample_row(logits[i], row, default_generator)
    for members in shared.values():
        tokens = _sample_rows(logits, members, rows, default_generator)
        for i, token in zip(members, tokens, strict=True):
            out[i] = token
    return out  # type: ignore[return-value]


def _sample_rows(
    logits: torch.Tensor,
    members: list[int],
    rows: list[SamplingRow],
    default_generator: torch.Generator,
) -> list[int | RequestFailure]:
    """Rows of identical sampling parameters and no seed, in one draw; row by row if that
    draw fails (so that only a row that cannot be sampled fails)."""
    if len(members) == 1:
        return [_sample_row(logits[members[0]], rows[members[0]], default_generator)]
    try:
        probs = _probs(logits[members], rows[members[0]].params)  # [n, vocab]
        return torch.multinomial(probs.cpu(), 1, generator=default_generator).view(-1).tolist()
    except Exception:  # noqa: BLE001 - retried row by row, where a failure is the row's own
        return [_sample_row(logits[i], rows[i], default_generator) for i in members]


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> dict[int, RequestFailure]:
    """While fewer than min_tokens are generated, EOS and stop token ids cannot be sampled.

    Returns the rows whose min_tokens or stop_token_ids cannot be applied.
    """
    failures: dict[int, RequestFailure] = {}
    for i, row in enumerate(rows):
        try:
            if row.num_output_tokens < row.params.min_tokens:
                banned = set(row.params.stop_token_ids)
                if not row.params.ignore_eos:
                    banned.update(row.eos_token_ids)
                banned = {t for t in banned if 0 <= t < logits.shape[1]}
                if banned:
                    logits[i, sorted(banned)] = float("-inf")
        except (TypeError, ValueError):
            param = "min_tokens" if not _is_int(row.params.min_tokens) else "stop_token_ids"
            failures[i] = RequestFailure(
                f"{param} must be a non-negative integer (a list of them for stop_token_ids)",
                FailureKind.REQUEST,
                param,
            )
    return failures


def _sample_row(
    row_logits: torch.Tensor, row: SamplingRow, default_generator: torch.Generator
) -> int | RequestFailure:
    refused = _check_params(row.params)
    if refused is not None:
        return refused
    try:
        probs = _probs(row_logits, row.params)  # [vocab]
        gen = row.generator or default_generator
        # multinomial on the CPU so that a seeded generator gives the same draw on any device
        return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
    except Exception as exc:  # noqa: BLE001 - fails this row only; logged once, here
        logger.exception("request %s: sampling failed; failing the request", row.request_id)
        return RequestFailure(f"sampling failed: {type(exc).__name__}", FailureKind.INTERNAL)


def _check_params(params: SamplingParams) -> RequestFailure | None:
    """The sampling parameters a non-greedy row needs, re-checked where a bad one would crash."""
    t, top_p, top_k = params.temperature, params.top_p, params.top_k
    if not (_is_number(t) and math.isfinite(t) and t > 0):
        message = f"temperature must be a finite number >= 0 (0 is greedy), got {_describe(t)}"
        return RequestFailure(message, FailureKind.REQUEST, "temperature")
    if not (_is_number(top_p) and 0 < top_p <= 1):
        message = f"top_p must be a number in (0, 1], got {_describe(top_p)}"
        return RequestFailure(message, FailureKind.REQUEST, "top_p")
    if not (_is_int(top_k) and top_k >= -1):
        message = f"top_k must be an integer >= 0 (0 or -1 disables it), got {_describe(top_k)}"
        return RequestFailure(message, FailureKind.REQUEST, "top_k")
    return None


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling probabilities over the last dimension ([vocab] or [rows, vocab])."""
    # Subtracting the max first keeps a tiny temperature finite: the best token scales to 0
    # and the rest to large negatives (or -inf), never inf - inf.
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    scaled = shifted / max(float(params.temperature), _MIN_TEMPERATURE)
    top_k = params.effective_top_k
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it included)
        drop = cumulative - sorted_probs > params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _non_finite(row: SamplingRow) -> RequestFailure:
    logger.error("request %s: the model produced NaN or +inf logits", row.request_id)
    return RequestFailure("the model produced NaN or +inf logits", FailureKind.INTERNAL)


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with `seed`, any integer in [-2**63, 2**64 - 1]."""
    if not (_is_int(seed) and SEED_MIN <= seed <= SEED_MAX):
        raise InvalidRequestError(
            f"seed must be an integer in [-2**63, 2**64 - 1], got {_describe(seed)}",
            param="seed",
        )
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _describe(value: object) -> str:
    """A short description of a bad value: a huge integer is not printed (repr refuses beyond
    4300 digits anyway), nor is a long string."""
    if _is_int(value) and abs(value) > 2**64:  # type: ignore[arg-type]
        return f"an integer of {value.bit_length()} bits"  # type: ignore[union-attr]
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"
