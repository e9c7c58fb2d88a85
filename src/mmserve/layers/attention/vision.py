"""Bidirectional ViT attention over packed segments: the metadata, the CPU reference, varlen.

A vision call packs many items (and, for Qwen2.5-VL, many windows) into one flat token
sequence. Attention stays inside a segment: a frame of one item, or one window. The segments are
described once per call on the host (`Segments`: `cu_seqlens` on the device, `max_seqlen` and an
optional host copy of the lengths), then every ViT block reads the same object.

Two paths:

- `segment_attention`: SDPA over batches of equal-length segments (the CPU path and the oracle).
- `varlen_segment_attention`: one `torch.nn.attention.varlen.varlen_attn` call (flash attention
  over `cu_seqlens`, CUDA, half precision): no Python loop over segments, nothing read from the
  host during forward, so it can be captured in a CUDA graph. Empty segments (repeated
  `cu_seqlens` values) are allowed: a padded call keeps a fixed number of segments that way.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Max attention-score elements per SDPA call (segments x heads x queries x keys): 1 GiB of
# float32 should a math kernel materialise them. A 3840x2160 image (42,196 patches, 16 heads)
# runs in chunks of ~400 queries.
MAX_SCORE_ELEMENTS = 1 << 28
VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # what the flash kernel behind varlen_attn takes
# Flash attention's head dims: multiples of 8 up to 256, powers of two or not (Qwen3-VL's 72
# runs in its 96-wide kernel). The reference path takes any head dim.
VARLEN_HEAD_DIM_MULTIPLE, VARLEN_MAX_HEAD_DIM = 8, 256


@dataclass(frozen=True)
class Segments:
    """Consecutive segments of a packed token sequence.

    `seqlens` is the host copy the reference path loops over; a segment layout whose values
    change between calls while the object stays (a CUDA graph's static buffers) has None there,
    and the reference path reads `cu_seqlens` instead.
    """

    cu_seqlens: torch.Tensor  # [num_segments + 1] int32, on the device; 0 first, total last
    max_seqlen: int  # an upper bound of the longest segment (the kernel's grid is sized by it)
    seqlens: tuple[int, ...] | None

    def __post_init__(self) -> None:
        assert self.cu_seqlens.dtype == torch.int32 and self.cu_seqlens.dim() == 1
        assert self.max_seqlen >= 0

    def host_seqlens(self) -> list[int]:
        if self.seqlens is not None:
            return list(self.seqlens)
        bounds = self.cu_seqlens.tolist()
        return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


def make_segments(
    seqlens: Sequence[int],
    device: torch.device | str,
    *,
    num_segments: int | None = None,
    max_seqlen: int | None = None,
    keep_host_copy: bool = True,
) -> Segments:
    """Segments of `seqlens` tokens; `num_segments` pads with empty segments to a fixed count,
    `max_seqlen` overrides the bound (both for a layout that must fit several calls)."""
    lengths = [int(n) for n in seqlens]
    if num_segments is not None:
        if len(lengths) > num_segments:
            raise ValueError(f"{len(lengths)} segments do not fit in {num_segments}")
        lengths += [0] * (num_segments - len(lengths))
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    longest = max(lengths, default=0)
    bound = longest if max_seqlen is None else max_seqlen
    if bound < longest:
        raise ValueError(f"max_seqlen {bound} is below the longest segment ({longest})")
    return Segments(
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device),
        max_seqlen=bound,
        seqlens=tuple(lengths) if keep_host_copy else None,
    )


def varlen_takes_head_dim(head_dim: int) -> bool:
    return 0 < head_dim <= VARLEN_MAX_HEAD_DIM and head_dim % VARLEN_HEAD_DIM_MULTIPLE == 0


def has_varlen(device: torch.device | str, dtype: torch.dtype, head_dim: int | None = None) -> bool:
    """Whether `varlen_segment_attention` runs here: CUDA, half precision, a head dim the flash
    kernel takes (when given), and a torch that has `torch.nn.attention.varlen` (2.10 and later;
    the CPU has no kernel behind it)."""
    if torch.device(device).type != "cuda" or dtype not in VARLEN_DTYPES:
        return False
    if head_dim is not None and not varlen_takes_head_dim(head_dim):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens: Sequence[int],
    scale: float,
    max_score_elements: int = MAX_SCORE_ELEMENTS,
) -> torch.Tensor:
    """Bidirectional attention within consecutive segments of `seqlens` tokens.

    q, k, v [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]. Segments of
    equal length are batched in one SDPA call (windows of one size are the common case);
    long segments have their queries chunked to stay under `max_score_elements`. Tokens past
    the last segment (none in a well-formed call) are left as zeros.
    """
    num_heads = q.shape[1]
    by_len: dict[int, list[int]] = defaultdict(list)
    start = 0
    for length in seqlens:
        if length:
            by_len[length].append(start)
        start += length
    # every token in a segment (the well-formed case): each is written below, none stays zero
    out = torch.empty_like(q) if start == q.shape[0] else torch.zeros_like(q)
    for length, starts in by_len.items():
        per_segment = num_heads * length * length
        segs_per_call = max(1, max_score_elements // per_segment)
        q_chunk = length
        if per_segment > max_score_elements:
            q_chunk = max(1, max_score_elements // (num_heads * length))
        offsets = torch.arange(length, device=q.device)
        for i in range(0, len(starts), segs_per_call):
            group = starts[i : i + segs_per_call]
            first, n = group[0], len(group)
            if group[-1] - first == (n - 1) * length:  # back to back (images of one size): views
                rows = slice(first, first + n * length)
                qs, ks, vs = (t[rows].unflatten(0, (n, length)).transpose(1, 2) for t in (q, k, v))
                dest = out[rows].unflatten(0, (n, length))  # [n, length, num_heads, head_dim]
            else:
                idx = torch.tensor(group, device=q.device).unsqueeze(1) + offsets  # [n, length]
                qs, ks, vs = (t[idx].transpose(1, 2) for t in (q, k, v))  # [n, heads, len, dim]
                dest = None
            for s in range(0, length, q_chunk):
                part = F.scaled_dot_product_attention(
                    qs[:, :, s : s + q_chunk], ks, vs, scale=scale
                ).transpose(1, 2)  # [n, q_chunk, num_heads, head_dim]
                if dest is not None:
                    dest[:, s : s + q_chunk].copy_(part)
                else:
                    out[idx[:, s : s + q_chunk]] = part
    return out


def varlen_segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments, scale: float
) -> torch.Tensor:
    """The same attention in one flash-attention launch over `segments.cu_seqlens`."""
    from torch.nn.attention.varlen import varlen_attn

    # varlen_attn's default scale is head_dim ** -0.5 (the ViT's); its `scale` argument came in a
    # later release than the function, so another scale is folded into q instead.
    head_dim = q.shape[-1]
    if scale != head_dim**-0.5:
        q = q * (scale * head_dim**0.5)
    cu, n = segments.cu_seqlens, segments.max_seqlen
    return varlen_attn(q, k, v, cu, cu, n, n)


# Opaque to torch.compile (`execution/compile.py`): the reference path loops in Python over
# host segment lengths; compiled code runs the dense parts of a block around it. Eager: no-op.
@torch.compiler.disable
def vision_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Segments,
    scale: float,
    *,
    use_varlen: bool,
) -> torch.Tensor:
    """q, k, v [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]."""
    if use_varlen:
        return varlen_segment_attention(q, k, v, segments, scale)
    return segment_attention(q, k, v, segments.host_seqlens(), scale)


@dataclass(frozen=True)
class VisionAttentionMetadata:
    """Everything the ViT blocks need besides the patches, built once per call on the host.

    Tokens are in the order the blocks see them: merge-block order, and for Qwen2.5-VL
    permuted by `window_index` (in whole 2x2 groups) so that every window is contiguous; the
    merger's output goes back to the input order through `window_inverse`.
    """

    positions: torch.Tensor  # [num_patches, 2] int64: (row, col) of each token, blocks' order
    full: Segments  # frames: the full-attention blocks' segments
    windowed: Segments  # windows (Qwen2.5-VL); `full` again for Qwen2-VL
    window_index: torch.Tensor | None  # [num_merged] int64: input merged token at each place
    window_inverse: torch.Tensor | None  # [num_merged] int64: argsort(window_index)
    use_varlen: bool  # attention by varlen_segment_attention, else the reference

    def __post_init__(self) -> None:
        assert (self.window_index is None) == (self.window_inverse is None)

    @property
    def num_patches(self) -> int:
        return self.positions.shape[0]
