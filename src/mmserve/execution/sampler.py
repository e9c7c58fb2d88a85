"""Token sampling for one step: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one request in this step."""

    params: SamplingParams
    generator: torch.Generator | None  # a per-request generator when params.seed is set
    num_output_tokens: int  # tokens generated before this step (for min_tokens)
    eos_token_ids: tuple[int, ...]


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator
) -> list[int]:
    """Pick one token per row of `logits` ([num_rows, vocab], any float dtype).

    Rows are sampled one by one with their own generator when they carry a seed, so a seeded
    request draws the same tokens whatever else shares its batch.
    """
    assert logits.shape[0] == len(rows)
    logits = logits.float()
    _apply_min_tokens(logits, rows)
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    out = [0] * len(rows)
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        for i, tok in zip(greedy, logits[idx].argmax(dim=-1).tolist(), strict=True):
            out[i] = tok
    for i, row in enumerate(rows):
        if row.params.is_greedy:
            continue
        probs = _probs(logits[i], row.params)  # [vocab]
        gen = row.generator or default_generator
        # multinomial on the CPU so that a seeded generator gives the same draw on any device
        out[i] = int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
    return out


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """While fewer than min_tokens are generated, EOS and stop token ids cannot be sampled."""
    for i, row in enumerate(rows):
        if row.num_output_tokens < row.params.min_tokens:
            banned = set(row.params.stop_token_ids)
            if not row.params.ignore_eos:
                banned.update(row.eos_token_ids)
            banned = {t for t in banned if 0 <= t < logits.shape[1]}
            if banned:
                logits[i, sorted(banned)] = float("-inf")


def _probs(row_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    scaled = row_logits / params.temperature
    top_k = params.effective_top_k
    if 0 < top_k < scaled.shape[0]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it included)
        drop = cumulative - sorted_probs > params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def make_generator(seed: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen
