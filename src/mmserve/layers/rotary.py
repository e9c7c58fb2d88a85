"""Rotary position embeddings: M-RoPE for the language model, 2-D axial RoPE for the ViT.

Both use the "rotate half" convention: a head vector x = [x1, x2] (halves) becomes
`x * cos + [-x2, x1] * sin`, with cos/sin laid out as [freqs, freqs] over the head dim.
Angles are computed and applied in float32 and the result is cast back to the input dtype.
"""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] by cos/sin [num_tokens, head_dim].

    Eagerly `rotate_half(x) * sin` is written half by half into one buffer (`-(x2 * s)` is
    `(-x2) * s` exactly), and the sum lands in `x * cos`'s: two temporaries instead of five,
    the same floats. A compiled graph keeps the plain formula, which inductor fuses whole, and
    so does a call autograd tracks."""
    x32 = x.float()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    tracked = torch.is_grad_enabled() and any(t.requires_grad for t in (x, cos, sin))
    if torch.compiler.is_compiling() or tracked:  # `out=` has no autograd
        return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)
    half = x.shape[-1] // 2
    out = x32 * cos
    rotated = torch.empty_like(out)
    torch.mul(x32[..., half:], sin[..., :half], out=rotated[..., :half]).neg_()
    torch.mul(x32[..., :half], sin[..., half:], out=rotated[..., half:])
    return out.add_(rotated).to(x.dtype)


def _inv_freq(dim: int, theta: float, device: torch.device) -> torch.Tensor:
    # [dim / 2]
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    return 1.0 / (theta**exponents)


def mrope_axes(mrope_section: tuple[int, ...], interleaved: bool) -> list[int]:
    """Which position axis (0 temporal, 1 height, 2 width) drives each of the head_dim / 2
    frequencies.

    Contiguous (Qwen2-VL, Qwen2.5-VL): the first s_t frequencies take T, the next s_h take H,
    the last s_w take W. Interleaved (Qwen3-VL, transformers' `apply_interleaved_mrope`):
    frequency i takes H when i % 3 == 1 and i < 3 * s_h, W when i % 3 == 2 and i < 3 * s_w,
    and T otherwise, so every axis gets low and high frequencies:

        (s_t, s_h, s_w) = (6, 3, 3):  contiguous  T T T T T T H H H W W W
                                      interleaved T H W T H W T H W T T T
    """
    if not interleaved:
        return [axis for axis, size in enumerate(mrope_section) for _ in range(size)]
    axes = []
    for i in range(sum(mrope_section)):
        axis = i % 3
        axes.append(axis if axis and i < 3 * mrope_section[axis] else 0)
    return axes


class MRotaryEmbedding(nn.Module):
    """Multimodal RoPE of Qwen2-VL: the head dim's frequency bands are split by `mrope_section`.

    With mrope_section = (s_t, s_h, s_w) (summing to head_dim / 2), the first s_t frequencies
    rotate by the temporal position, the next s_h by the height position and the last s_w by
    the width position (`interleaved`: Qwen3-VL's order, see `mrope_axes`). Text tokens have
    equal positions on all three axes, so for text this is ordinary 1-D RoPE.

        frequency index:  0 ........ s_t-1 | s_t ...... s_t+s_h-1 | ... head_dim/2 - 1
        position axis:    temporal (0)     | height (1)           | width (2)
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        mrope_section: tuple[int, int, int],
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        if sum(mrope_section) * 2 != head_dim:
            raise ValueError(
                f"mrope_section {mrope_section} must sum to head_dim/2={head_dim // 2}"
            )
        self.head_dim = head_dim
        self.theta = theta
        self.mrope_section = tuple(mrope_section)
        self.interleaved = interleaved
        # device -> (inv_freq, axis): made once per device, not per step (float32 whatever
        # the model's dtype: plain attributes, which `.to()` leaves alone)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, num_tokens] (or [num_tokens], text) -> cos, sin [num_tokens, head_dim]."""
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(3, -1)
        inv_freq, axis = self._device_tables(positions.device)
        # [3, num_tokens, head_dim / 2]: the angle of every frequency on every axis
        freqs = positions.float().unsqueeze(-1) * inv_freq
        index = axis.view(1, 1, -1).expand(1, freqs.shape[1], -1)
        freqs = freqs.gather(0, index).squeeze(0)  # [num_tokens, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def _device_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """inv_freq [head_dim / 2] and which axis drives each frequency [head_dim / 2], made
        on `device` the first time it asks. Filled on the device: a host list copied here
        would sync the device and break a CUDA graph's capture."""
        tables = self._tables.get(device)
        if tables is None:
            inv_freq = _inv_freq(self.head_dim, self.theta, device)
            tables = self._tables[device] = (inv_freq, self._axis(device))
        return tables

    def _axis(self, device: torch.device) -> torch.Tensor:
        """`mrope_axes` as a [head_dim / 2] tensor made on `device` (no host copy)."""
        if not self.interleaved:
            return torch.cat(
                [
                    torch.full((size,), i, dtype=torch.long, device=device)
                    for i, size in enumerate(self.mrope_section)
                ]
            )
        index = torch.arange(self.head_dim // 2, dtype=torch.long, device=device)
        residue = index % 3
        _, s_h, s_w = self.mrope_section
        axis = torch.where((residue == 1) & (index < 3 * s_h), 1, 0)
        return torch.where((residue == 2) & (index < 3 * s_w), 2, axis)


class VisionRotaryEmbedding(nn.Module):
    """2-D axial RoPE of the ViT: half the head dim rotates by the row, half by the column.

    cos/sin layout over the head dim: [row freqs (d/4), col freqs (d/4)] repeated twice.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self._inv_freqs: dict[torch.device, torch.Tensor] = {}  # as MRotaryEmbedding._tables

    def forward(self, hw_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hw_positions [num_patches, 2] (row, col) -> cos, sin [num_patches, head_dim]."""
        device = hw_positions.device
        inv_freq = self._inv_freqs.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freqs[device] = _inv_freq(self.head_dim // 2, self.theta, device)
        # [num_patches, 2, head_dim / 4] -> [num_patches, head_dim / 2]
        freqs = (hw_positions.float().unsqueeze(-1) * inv_freq).flatten(1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()
