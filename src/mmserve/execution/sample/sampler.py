"""Token sampling for one step, on the device for the whole batch, with one host copy.

Order: min_tokens bans EOS, then logit_bias and penalties (only rows that have some), then
allowed_token_ids and bad_words (`masks.py`), then a grammar's bitmask, then greedy rows take
the argmax and random rows draw by race (temperature, min-p, top-k, top-p; see `noise.py`).
Everything the host decides (which rows are greedy, their parameters, their keys) is sent with
non-blocking copies; the only read back is one `[3, num_rows]` copy of tokens and flags
(`sample`), logprobs joined to it by `step.py`.

A row that cannot be sampled (parameters that slipped past validation, NaN or +inf logits, a
draw of a token of zero probability) gets a `RequestFailure` instead of a token; the other rows
are unaffected.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmserve.errors import FailureKind, RequestFailure
from mmserve.execution.host_copy import fill_cells_, to_device
from mmserve.execution.sample.bitmask import apply_token_bitmask_
from mmserve.execution.sample.masks import apply_token_masks
from mmserve.execution.sample.noise import (
    draw_keys,
    exponential_noise,
    hashed_noise,
    seeded_keys,
)
from mmserve.execution.sample.penalties import apply_penalties
from mmserve.execution.sample.rows import SamplingRow
from mmserve.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, check_seed

logger = logging.getLogger(__name__)

# Dividing float32 logits by less than this underflows the divisor to 0 (and 0/0 is NaN).
_MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class DeviceDraw:
    """One step's picks, still on the device, and what the host already knows failed."""

    tokens: torch.Tensor  # [num_rows] int64
    is_finite: torch.Tensor  # [num_rows] bool: no NaN or +inf logit, some token allowed
    is_drawn: torch.Tensor  # [num_rows] bool: the pick has a positive probability
    failures: dict[int, RequestFailure]  # rows refused on the host (their pick is garbage)

    def host_flags(self) -> torch.Tensor:
        """[3, num_rows] int64: tokens, finite flags, drawn flags (one copy for all three)."""
        return torch.stack([self.tokens, self.is_finite.long(), self.is_drawn.long()])


def sample(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    default_generator: torch.Generator,
    *,
    token_bitmask: torch.Tensor | None = None,
) -> list[int | RequestFailure]:
    """Pick one token per row of `logits` ([num_rows, vocab], any float dtype; edited in
    place when it is float32). `token_bitmask` ([num_rows, ceil(vocab / 32)] int32, structured
    output) disallows tokens per row; -1 words allow everything. A seeded row draws the same
    tokens whatever else shares its batch, on any device."""
    draw = sample_on_device(logits, rows, default_generator, token_bitmask=token_bitmask)
    return resolve_draw(draw, draw.host_flags().tolist(), rows)


def sample_on_device(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    default_generator: torch.Generator,
    *,
    token_bitmask: torch.Tensor | None = None,
) -> DeviceDraw:
    """Everything of `sample` but the read back: no host value depends on a device value."""
    assert logits.shape[0] == len(rows)
    logits = logits.float()
    failures = _apply_min_tokens(logits, rows)
    failures.update(apply_penalties(logits, rows))  # nothing to do unless a row has some
    failures.update(apply_token_masks(logits, rows))  # likewise
    if token_bitmask is not None:
        apply_token_bitmask_(logits, token_bitmask)
    # One pass gives the greedy picks and, since max propagates NaN and +inf, which rows are
    # broken (a row whose every token is -inf cannot be sampled either).
    best = logits.max(dim=-1)  # values, indices: [num_rows] each
    tokens = best.indices
    is_drawn = torch.ones(len(rows), dtype=torch.bool, device=logits.device)
    random_idx = []
    for i, row in enumerate(rows):
        if i in failures or row.params.is_greedy:
            continue
        refused = _check_params(row.params)
        if refused is not None:
            failures[i] = refused
        else:
            random_idx.append(i)
    drawn = _draw_rows(logits, rows, random_idx, default_generator, failures)
    if drawn is not None:
        drawn_idx, picks, picked = drawn
        index = to_device(drawn_idx, torch.long, logits.device)
        tokens = tokens.index_copy(0, index, picks)
        is_drawn = is_drawn.index_copy(0, index, picked)
    return DeviceDraw(tokens, torch.isfinite(best.values), is_drawn, failures)


def _draw_rows(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    random_idx: list[int],
    default_generator: torch.Generator,
    failures: dict[int, RequestFailure],
) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
    """The random rows in one draw: (rows drawn, picks, drawn flags). If the batched draw
    raises, row by row, so that only a row that cannot be drawn fails (into `failures`)."""
    if not random_idx:
        return None
    try:
        index = to_device(random_idx, torch.long, logits.device)
        return random_idx, *_draw(logits[index], [rows[i] for i in random_idx], default_generator)
    except Exception:  # noqa: BLE001 - retried row by row, where a failure is the row's own
        logger.warning("a batched draw failed; drawing row by row")
    drawn_idx, picks, picked = [], [], []
    for i in random_idx:
        try:
            pick, ok = _draw(logits[i : i + 1], [rows[i]], default_generator)
        except Exception as exc:  # noqa: BLE001 - fails this row only; logged once, here
            logger.exception("request %s: sampling failed; failing the request", rows[i].request_id)
            failures[i] = RequestFailure(
                f"sampling failed: {type(exc).__name__}", FailureKind.INTERNAL
            )
            continue
        drawn_idx.append(i)
        picks.append(pick)
        picked.append(ok)
    return (drawn_idx, torch.cat(picks), torch.cat(picked)) if drawn_idx else None


def resolve_draw(
    draw: DeviceDraw, host: list[list[int]], rows: Sequence[SamplingRow]
) -> list[int | RequestFailure]:
    """Tokens and failures per row from the host copy of `draw.host_flags()`."""
    tokens, is_finite, is_drawn = host
    out: list[int | RequestFailure] = []
    for i, row in enumerate(rows):
        if not is_finite[i]:
            out.append(_non_finite(row))
        elif i in draw.failures:
            out.append(draw.failures[i])
        elif not is_drawn[i]:
            logger.error("request %s: sampling drew a token of zero probability", row.request_id)
            out.append(RequestFailure("sampling failed: no token to draw", FailureKind.INTERNAL))
        else:
            out.append(tokens[i])
    return out


def _draw(
    logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows ([n, vocab] float32) by race: tokens [n] int64 and drawn flags [n] bool."""
    n, vocab_size = logits.shape
    device = logits.device
    values = [
        [max(float(r.params.temperature), _MIN_TEMPERATURE) for r in rows],
        [float(r.params.effective_top_k) for r in rows],
        [float(r.params.top_p) for r in rows],
        [float(r.params.min_p) for r in rows],
    ]
    temperature, top_k, top_p, min_p = to_device(values, torch.float32, device)  # [n] each
    # Subtracting the max first keeps a tiny temperature finite: the best token scales to 0
    # and the rest to large negatives (or -inf), never inf - inf.
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / temperature[:, None]
    if any(r.params.min_p > 0.0 for r in rows):
        # p / p_max = exp(scaled - 0): keep p >= min_p * p_max (log 0 = -inf keeps all)
        scaled = scaled.masked_fill(scaled < torch.log(min_p)[:, None], float("-inf"))
    ks = [int(r.params.effective_top_k) for r in rows]
    max_k = max((k for k in ks if 0 < k < vocab_size), default=0)
    if max_k:
        top = torch.topk(scaled, max_k, dim=-1).values  # [n, max_k]
        column = (top_k.long().clamp(1, max_k) - 1)[:, None]
        kth = top.gather(1, column)  # [n, 1]
        has_k = ((top_k > 0) & (top_k < vocab_size))[:, None]
        scaled = scaled.masked_fill(has_k & (scaled < kth), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [n, vocab]
    if any(r.params.top_p < 1.0 for r in rows):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it included)
        limit = torch.where(top_p < 1.0, top_p, float("inf"))[:, None]
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > limit
        probs = probs.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), 0.0)
    noise = _noise(rows, vocab_size, default_generator, device)  # [n, vocab]
    picks = (probs / noise).argmax(dim=-1)  # [n]
    return picks, probs.gather(1, picks[:, None])[:, 0] > 0


def _noise(
    rows: list[SamplingRow],
    vocab_size: int,
    default_generator: torch.Generator,
    device: torch.device,
) -> torch.Tensor:
    """Exp(1) noise per row: hashed from keys where a row is seeded (keys from its seed and
    position) or where the engine's generator lives on another device (keys drawn from it),
    else from the engine's generator on the device."""
    shared = default_generator.device.type == device.type
    hashed = [i for i, r in enumerate(rows) if r.params.seed is not None or not shared]
    if len(hashed) < len(rows):
        noise = exponential_noise(len(rows), vocab_size, default_generator, device)
    else:
        noise = torch.empty(len(rows), vocab_size, dtype=torch.float32, device=device)
    if hashed:
        keys = [_keys(rows[i], default_generator) for i in hashed]
        index = to_device(hashed, torch.long, device)
        noise[index] = hashed_noise(to_device(keys, torch.int64, device), vocab_size)
    return noise


def _keys(row: SamplingRow, default_generator: torch.Generator) -> tuple[int, int]:
    seed = row.params.seed
    if seed is None:
        return draw_keys(default_generator)
    return seeded_keys(seed, row.num_output_tokens)


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> dict[int, RequestFailure]:
    """While fewer than min_tokens are generated, EOS and stop token ids cannot be sampled
    (one batched write for every row). Returns the rows whose min_tokens or stop_token_ids
    cannot be applied."""
    failures: dict[int, RequestFailure] = {}
    row_idx: list[int] = []
    token_idx: list[int] = []
    for i, row in enumerate(rows):
        try:
            if row.num_output_tokens < row.params.min_tokens:
                banned = set(row.params.stop_token_ids)
                if not row.params.ignore_eos:
                    banned.update(row.eos_token_ids)
                banned = sorted(t for t in banned if 0 <= t < logits.shape[1])
                row_idx.extend([i] * len(banned))
                token_idx.extend(banned)
        except (TypeError, ValueError):
            param = "min_tokens" if not _is_int(row.params.min_tokens) else "stop_token_ids"
            failures[i] = RequestFailure(
                f"{param} must be a non-negative integer (a list of them for stop_token_ids)",
                FailureKind.REQUEST,
                param,
            )
    if row_idx:
        fill_cells_(logits, row_idx, token_idx, float("-inf"))
    return failures


def _check_params(params: SamplingParams) -> RequestFailure | None:
    """The sampling parameters a non-greedy row needs, re-checked where a bad one would crash."""
    t, top_p, top_k = params.temperature, params.top_p, params.top_k
    if not (_is_number(t) and math.isfinite(t) and t > 0):
        message = f"temperature must be a finite number >= 0 (0 is greedy), got {_describe(t)}"
        return RequestFailure(message, FailureKind.REQUEST, "temperature")
    if not (_is_number(top_p) and 0 < top_p <= 1):
        message = f"top_p must be a number in (0, 1], got {_describe(top_p)}"
        return RequestFailure(message, FailureKind.REQUEST, "top_p")
    if not (_is_number(params.min_p) and 0 <= params.min_p <= 1):
        message = f"min_p must be a number in [0, 1], got {_describe(params.min_p)}"
        return RequestFailure(message, FailureKind.REQUEST, "min_p")
    if not (_is_int(top_k) and top_k >= -1):
        message = f"top_k must be an integer >= 0 (0 or -1 disables it), got {_describe(top_k)}"
        return RequestFailure(message, FailureKind.REQUEST, "top_k")
    seed = params.seed
    if seed is not None and not (_is_int(seed) and SEED_MIN <= seed <= SEED_MAX):
        message = f"seed must be an integer in [-2**63, 2**64 - 1], got {_describe(seed)}"
        return RequestFailure(message, FailureKind.REQUEST, "seed")
    return None


def _non_finite(row: SamplingRow) -> RequestFailure:
    logger.error("request %s: the model produced NaN or +inf logits", row.request_id)
    return RequestFailure("the model produced NaN or +inf logits", FailureKind.INTERNAL)


def make_device_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with `seed` (the engine's, for unseeded rows)."""
    check_seed(seed)
    gen = torch.Generator(device=device)
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
