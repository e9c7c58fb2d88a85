"""uint8 patches to the vision tower's input on the device: each item's `PixelNormalization`
applied bit-identically to the float32 values transformers' processors make.

The CPU stage ships levels (1 byte per value); here they cross to the device as uint8 (a
quarter of float32's bytes) and become floats by one of two routes:

- Arithmetic (a float32 tower): the levels cast to float32, then the normalisation's own
  float32 operations in place, e.g. `x / 255` then `(x - mean) / std` per channel. Each is one
  correctly rounded IEEE operation per value, so the result is the same whatever the kernel;
  the form is still checked once per normalisation and row width against the table below, on
  all 256 levels of every column, and used only where it matches everywhere. An image's
  rescale (`level * rescale_factor` in float64, then rounded to float32) has no exact float32
  twin in general; for the usual 1/255 a division by 255 is one (checked, like the rest).
- A lookup table otherwise (another dtype, or no exact form): levels cast to int32 plus a
  channel offset (c * 256) index the flat [C * 256] table of the item's normalisation, each
  entry the float32 value rounded once to the tower's dtype: exactly what rounding the float32
  patch would give.

The arithmetic route is ~6x cheaper on a CPU (0.6 against 3.5 ms per 448x448 image on one
core): the gather does not vectorise. On a CPU the work is also memory-bound, and what it costs
is pages: sixteen 448x448 images are 19M values, a 77 MB float32 output, above glibc's largest
mmap threshold, so a fresh one per call faulted ~40k pages in (~28 ms per image of the engine's
one core). So on a CPU each item is converted in blocks of `CHUNK_ROWS` rows (the temporaries
stay warm) into an output workspace the normaliser keeps (`reuse_output`), grown to the largest
call and valid until the next call; a GPU converts each item in one pass into a fresh tensor
from its caching allocator.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

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
        self._forms: dict[tuple[PixelNormalization, int], _Arithmetic | None] = {}
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
        if out is None:
            out = torch.empty((n, dim), dtype=self.dtype, device=self.device)
        form = self._form(norm, dim)
        if form is not None:
            return form.apply_(out.copy_(levels))
        # [n, dim] int32: a cast, then an add of like types (a uint8 + int32 add promotes
        # element by element, twice as slow on a CPU)
        index = levels.to(torch.int32).add_(self._channel_offsets(dim))
        torch.index_select(self._table(norm), 0, index.view(-1), out=out.view(-1))
        return out

    def _form(self, norm: PixelNormalization, dim: int) -> _Arithmetic | None:
        """The exact arithmetic form of `norm` for rows of `dim` values, if any (module
        docstring): the first candidate that gives the table's value for every level in every
        column."""
        key = (norm, dim)
        if key not in self._forms:
            self._forms[key] = None
            if self.dtype == torch.float32:
                channel = torch.arange(dim, device=self.device) // (dim // 3)
                # want[level, col]: the table's value of `level` in col's channel
                want = self._table(norm).view(3, 256)[channel].T
                levels = torch.arange(256, dtype=torch.float32, device=self.device)
                for form in _candidate_forms(norm, channel):
                    if torch.equal(form.apply_(levels[:, None].repeat(1, dim)), want):
                        self._forms[key] = form
                        break
        return self._forms[key]

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


@dataclass(frozen=True)
class _Arithmetic:
    """float32 operations on a [n, dim] tensor of levels, in place: a scalar rescale (`x * s` or
    `x / s`), then `(x - mean) / std` with a value per column (its channel's)."""

    scale_op: str | None  # "mul", "div" or None
    scale: float
    mean: torch.Tensor | None  # [dim] float32
    std: torch.Tensor | None

    def apply_(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale_op == "mul":
            x.mul_(self.scale)
        elif self.scale_op == "div":
            x.div_(self.scale)
        if self.mean is not None and self.std is not None:
            x.sub_(self.mean).div_(self.std)
        return x


def _candidate_forms(norm: PixelNormalization, channel: torch.Tensor) -> list[_Arithmetic]:
    """Arithmetic forms that may reproduce `norm.value_table()` exactly (checked by the caller),
    most likely first; `channel` [dim]: each column's channel."""

    def per_column(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values.astype(np.float32)).to(channel.device)[channel]

    mean = np.asarray(norm.mean, dtype=np.float32)
    std = np.asarray(norm.std, dtype=np.float32)
    if norm.order == "rescale_then_normalize":
        scales = [(None, 1.0)]
        if norm.do_rescale:  # the float32 twins of a float64 multiply, each rounded once
            reciprocal = float(np.float32(1.0 / norm.rescale_factor))
            scales = [("div", reciprocal), ("mul", float(np.float32(norm.rescale_factor)))]
        shift, divide = (per_column(mean), per_column(std)) if norm.do_normalize else (None, None)
        return [_Arithmetic(op, s, shift, divide) for op, s in scales]
    if norm.do_normalize:  # (level - mean * r') / (std * r'), r' = 1 / rescale, in float32
        scale = np.float32(1.0 / norm.rescale_factor) if norm.do_rescale else np.float32(1.0)
        return [_Arithmetic(None, 1.0, per_column(mean * scale), per_column(std * scale))]
    if norm.do_rescale:
        return [_Arithmetic("mul", float(np.float32(norm.rescale_factor)), None, None)]
    return [_Arithmetic(None, 1.0, None, None)]


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
