"""uint8 patches to the vision tower's input on the device: each item's `PixelNormalization`
applied as a lookup table, bit-identical to the float32 values transformers' processors make.

The CPU stage ships levels (1 byte per value); here they cross to the device as uint8 (a
quarter of float32's bytes) and become floats in one gather:

    levels [n, C*T*P*P] uint8 --int32 + channel offset (c * 256)--> index into the flat
    [C * 256] table of the item's normalisation, already in the tower's dtype --> [n, C*T*P*P]

A table entry is the float32 value of that level rounded once to the tower's dtype, exactly
what rounding the float32 patch would give, so the tower reads the same numbers as when the
API process normalised.

On a CPU the work is memory-bound, and what it costs is pages, not arithmetic: sixteen 448x448
images are 19M values, a 77 MB float32 output and as big an int32 index, both above glibc's
largest mmap threshold, so each call faulted ~40k fresh pages in (~28 ms per image of the
engine's one core, half of a request's model work on the tiny benchmark checkpoint). So on a
CPU the gather runs per item in blocks of `CHUNK_ROWS` rows (the index a heap block that stays
warm) into an output workspace the normaliser keeps (`reuse_output`), grown to the largest
call and valid until the next call; a GPU gathers each item in one pass into a fresh tensor
from its caching allocator.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from mmserve.multimodal import EncoderInput, PixelNormalization

# Rows gathered at a time on a CPU: a 448x448 image's 1024 patches, 4.8 MB of int32 index.
CHUNK_ROWS = 1024


class PixelNormalizer:
    """Turns a batch of items' uint8 patches into one float tensor on `device` in `dtype`;
    tables are built once per distinct normalisation (a checkpoint has one per modality).

    With `reuse_output` (a CPU engine's encoder runner: one caller, which hands the result to
    the tower and drops it) every call writes into the same workspace, so the tensor a call
    returns is overwritten by the next one. Elsewhere each call returns a tensor of its own.
    """

    def __init__(
        self, device: torch.device, dtype: torch.dtype, *, reuse_output: bool = False
    ) -> None:
        self.device = device
        self.dtype = dtype
        self._tables: dict[PixelNormalization, torch.Tensor] = {}
        self._offsets: dict[int, torch.Tensor] = {}
        self._chunk_rows = CHUNK_ROWS if device.type == "cpu" else None
        self._reuse_output = reuse_output
        self._workspace: torch.Tensor | None = None

    def __call__(self, items: Sequence[EncoderInput]) -> torch.Tensor:
        """[sum of num_patches, C*T*P*P] in `dtype`, the items concatenated in order."""
        for item in items:  # a bug if not: EncoderInput refuses anything else on construction
            assert item.pixel_values.dtype == np.uint8, item.pixel_values.dtype
        total = sum(item.pixel_values.shape[0] for item in items)
        out = self._output(total, items[0].pixel_values.shape[1])
        row = 0
        for item in items:  # no concatenation: each item's levels go straight to its rows
            levels = _as_tensor(item.pixel_values).to(self.device, non_blocking=True)
            num_rows = levels.shape[0]
            step = self._chunk_rows or num_rows
            for start in range(0, num_rows, step):
                stop = min(start + step, num_rows)
                dest = out[row + start : row + stop]
                self.apply(levels[start:stop], item.normalization, out=dest)
            row += num_rows
        return out

    def _output(self, rows: int, dim: int) -> torch.Tensor:
        if not self._reuse_output:
            return torch.empty((rows, dim), dtype=self.dtype, device=self.device)
        if self._workspace is None or self._workspace.numel() < rows * dim:
            self._workspace = None  # the old one goes before the new one is allocated
            self._workspace = torch.empty(rows * dim, dtype=self.dtype, device=self.device)
        return self._workspace[: rows * dim].view(rows, dim)

    def apply(
        self, levels: torch.Tensor, norm: PixelNormalization, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """levels [n, C*T*P*P] uint8 on the device -> values [n, C*T*P*P] in `dtype`, written
        into `out` (contiguous, same shape) when given."""
        n, dim = levels.shape
        # [n, dim] int32: a cast, then an add of like types (a uint8 + int32 add promotes
        # element by element, twice as slow on a CPU)
        index = levels.to(torch.int32).add_(self._channel_offsets(dim))
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
