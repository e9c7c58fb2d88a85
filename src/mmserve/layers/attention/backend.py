"""The attention backend seam: what the model runner and the decoder layers ask of a backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from mmserve.layers.attention.buffers import AttentionBuffers
from mmserve.layers.attention.metadata import AttentionForward, AttentionMetadata


class AttentionBackend(AttentionForward, Protocol):
    """Paged causal attention over a flat batch of prefill chunks and decodes.

    Contract:

    - `build_metadata` runs once per step on the host, before the forward and outside it. It
      validates the batch and returns an `AttentionMetadata` holding *everything* `forward`
      needs (device tensors, host copies, the backend's own plan: decode groups, query tiles),
      with `metadata.backend is self`. With `buffers` (`buffers.py`, allocated once at
      start-up) its tensors are views of them, filled by non-blocking copies: a step allocates
      no tensor for its metadata. Every decoder layer shares it; `forward` builds no index
      tensor and reads no host value that would sync the device.
    - `forward(query, key, value, kv_cache, metadata, scale)` first stores the new tokens' K/V
      at `metadata.slot_mapping` in `kv_cache` (in place, cast to the cache's dtype), then
      returns the attention of every new token over its sequence's cached tokens and its own
      earlier new tokens: query [num_tokens, num_heads, head_dim], key/value
      [num_tokens, num_kv_heads, head_dim] (already rotated), kv_cache
      [2, num_blocks, block_size, num_kv_heads, head_dim]; the result is
      [num_tokens, num_heads, head_dim] in the cache's dtype. It changes no cache slot other
      than those of `slot_mapping`.
    - Backends agree with `TorchAttentionBackend` (the reference) to rounding.

    CUDA-graph capture of pure-decode steps (one new token per sequence) goes through three
    hooks, so graph code never knows which backend it captures:

    - `init_capture` allocates the fixed buffers every captured graph reads (batches of up to
      `max_num_seqs` sequences);
    - `prepare_for_capture(num_seqs)` returns the metadata a graph of `num_seqs` rows is
      captured with: views of those buffers, padded rows included (`has_padding`);
    - `prepare_for_replay(metadata, num_seqs)` copies a step's metadata into the buffers (device
      to device) and fills rows past the step's as padding: slot -1 (nothing stored), one key
      of a dummy block (read only, output dropped). False when the step does not fit the
      buffers: the caller runs it eagerly.

    A backend whose `supports_capture` is False raises ValueError from `init_capture`.
    """

    name: str
    supports_capture: bool

    def build_metadata(
        self,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str,
        *,
        buffers: AttentionBuffers | None = None,
    ) -> AttentionMetadata: ...

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...

    def init_capture(
        self,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> None: ...

    def prepare_for_capture(self, num_seqs: int) -> AttentionMetadata: ...

    def prepare_for_replay(self, metadata: AttentionMetadata, num_seqs: int) -> bool: ...
