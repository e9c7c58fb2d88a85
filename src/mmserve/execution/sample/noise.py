"""Exponential noise for sampling by race: batched on the device, seeded rows by a counter hash.

Sampling by race: with q ~ Exp(1) drawn independently per token, `argmax(probs / q)` is a draw
from `probs` (the exponential-race form of Gumbel-max), so a whole batch samples in one argmax
and nothing leaves the device.

A seeded row's noise must not depend on its batchmates, its device, a preemption or which
process samples it. It is a pure function of the row's seed, the position of the token it draws
(the number of tokens generated before it) and the token id:

    key0, key1 = halves of splitmix64(splitmix64(seed mod 2**64) ^ position)   (on the host)
    h = mix(mix(token ^ key0) ^ key1)          mix: a 32-bit integer finaliser (lowbias32)
    u = (h >> 9 + 0.5) / 2**23  in (0, 1)     q = -log(u)

So no random state travels with a request: a seed (an integer) is all a runner needs.

Every product is split so that it stays below 2**63: int64 arithmetic that never overflows, so
u is bit-identical on the CPU and on CUDA. q is not quite: each device's float32 log rounds in
its own way (the H200 and this CPU differ by an ulp on some tokens), so a seeded row draws the
same token on every device unless two tokens' ratios probs / q tie to within that ulp. Unseeded
rows take Exp(1) noise from the engine's generator (cheaper than the hash; `exponential_noise`).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
# Smallest q: a ratio probs / q stays finite, and a zero probability stays 0.
_MIN_NOISE = torch.finfo(torch.float32).tiny


def seeded_keys(seed: int, position: int) -> tuple[int, int]:
    """The two 32-bit keys of a seeded row's draw at output `position` (tokens generated
    before it): the same wherever and whenever the draw happens."""
    h = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return h & _MASK32, h >> 32


def draw_keys(generator: torch.Generator) -> tuple[int, int]:
    """Two 32-bit keys from a host generator: an unseeded row's draw when the engine's
    generator lives on another device than the logits."""
    k0, k1 = torch.randint(0, 1 << 32, (2,), generator=generator, dtype=torch.int64).tolist()
    return int(k0), int(k1)


def hashed_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [num_rows, vocab_size] float32 from keys [num_rows, 2] int64 (device)."""
    return (-torch.log(hashed_uniform(keys, vocab_size))).clamp_min_(_MIN_NOISE)


def hashed_uniform(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The uniforms u in (0, 1) behind `hashed_noise`: bit-identical on every device."""
    token = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)  # [vocab]
    h = _mix(token[None, :] ^ keys[:, :1])  # [num_rows, vocab]
    h = _mix(h ^ keys[:, 1:])
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))  # exact in float32


def exponential_noise(
    num_rows: int, vocab_size: int, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """Exp(1) noise [num_rows, vocab_size] float32 from `generator` (on `device`'s type).

    On a CPU torch's `exponential_` draws element by element (~20 ns each, 0.33 ms for 16 rows
    of a 1024-token vocabulary); a uniform draw and `-log1p(-u)` vectorise (0.08 ms): the same
    distribution (u in [0, 1), so q in [0, 16.7)). CUDA keeps the one `exponential_` kernel."""
    noise = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
    if noise.device.type == "cpu":
        noise.uniform_(generator=generator).neg_().log1p_().neg_()
    else:
        noise.exponential_(generator=generator)
    return noise.clamp_min_(_MIN_NOISE)


def _splitmix64(x: int) -> int:
    """SplitMix64's finaliser (Steele et al.) on a Python int in [0, 2**64): host-side only."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Chris Wellons' 32-bit finaliser) on int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32): two 16-bit halves of c, no int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32
