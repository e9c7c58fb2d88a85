"""uint8 patches to the vision tower's input on the device: each item's `PixelNormalization`
applied as a lookup table, bit-identical to the float32 values transformers' processors make.

The CPU stage ships levels (1 byte per value); here they cross to the device as uint8 (a
quarter of float32's bytes) and become floats in one gather:

    levels [n, C*T*P*P] uint8 --int32 + channel offset (c * 256)--> index into the flat
    [C * 256] table of the item's normalisation, already in the tower's dtype --> [n, C*T*P*P]

A table entry is the float32 value of that level rounded once to the tower's dtype, exactly
what rounding the float32 patch would give, so the tower reads the same numbers as when the
API process normalised.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from mmserve.multimodal import EncoderInput, PixelNormalization


class PixelNormalizer:
    """Turns a batch of items' uint8 patches into one float tensor on `device` in `dtype`;
    tables are built once per distinct normalisation (a checkpoint has one per modality)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self._tables: dict[PixelNormalization, torch.Tensor] = {}
        self._offsets: dict[int, torch.Tensor] = {}

    def __call__(self, items: Sequence[EncoderInput]) -> torch.Tensor:
        """[sum of num_patches, C*T*P*P] in `dtype`, the items concatenated in order."""
        arrays = [item.pixel_values for item in items]
        for item in items:  # a bug if not: EncoderInput refuses anything else on construction
            assert item.pixel_values.dtype == np.uint8, item.pixel_values.dtype
        # [total_patches, C*T*P*P] uint8
        joined = np.concatenate(arrays, axis=0) if len(arrays) > 1 else arrays[0]
        levels = _as_tensor(joined).to(self.device, non_blocking=True)
        out = torch.empty(levels.shape, dtype=self.dtype, device=self.device)
        row = 0
        for norm, num_rows in _runs(items):
            self.apply(levels[row : row + num_rows], norm, out=out[row : row + num_rows])
            row += num_rows
        return out

    def apply(
        self, levels: torch.Tensor, norm: PixelNormalization, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """levels [n, C*T*P*P] uint8 on the device -> values [n, C*T*P*P] in `dtype`, written
        into `out` (contiguous, same shape) when given."""
        n, dim = levels.shape
        # [n, dim] int32 in one pass (uint8 + int32 promotes to int32)
        index = torch.add(levels, self._channel_offsets(dim))
        if out is None:
            out = torch.empty((n, dim), dtype=self.dtype, device=self.device)
        torch.index_select(self._table(norm), 0, index.view(-1), out=out.view(-1))
        return out

    def _table(self, norm: PixelNormalization) -> torch.Tensor:
        table = self._tables.get(norm)
        if table is None:
            flat = torch.from_numpy(norm.value_table().reshape(-1))  # [C * 256] float32
            table = flat.to(device=self.device, dtype=self.dtype)
            self._tables[norm] = table
        return table

    def _channel_offsets(self, dim: int) -> torch.Tensor:
        offsets = self._offsets.get(dim)
        if offsets is None:
            per_channel = dim // 3  # rows are channel-major: [C, T, P, P] flattened
            channel = torch.arange(dim, dtype=torch.int32) // per_channel
            offsets = (channel * 256).to(self.device)  # [dim]
            self._offsets[dim] = offsets
        return offsets


def _runs(items: Sequence[EncoderInput]) -> list[tuple[PixelNormalization, int]]:
    """Consecutive items that share a normalisation, as (normalisation, rows)."""
    runs: list[tuple[PixelNormalization, int]] = []
    for item in items:
        rows = item.pixel_values.shape[0]
        if runs and runs[-1][0] == item.normalization:
            runs[-1] = (item.normalization, runs[-1][1] + rows)
        else:
            runs.append((item.normalization, rows))
    return runs


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """The array as a tensor without a copy, read-only arrays included.

    Pixels decoded from wire frames are read-only views of the received message; torch warns
    about those because a write through the tensor would be undefined. Only reads follow (the
    gather makes a new tensor), so the warning does not apply.
    """
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)
