"""The runner-side encoder cache: identifier -> embeddings tensor on the model's device."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class EncoderCache:
    """Embeddings of encoded items, by identifier, on the model's device and in its dtype.

    The scheduler decides what lives here: it asks for items to be encoded and, after logical
    eviction, names the identifiers to drop (`free`). This class never evicts on its own; its
    `num_bytes` is what the scheduler's ledger counts.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self._embeddings: dict[str, torch.Tensor] = {}

    def __contains__(self, identifier: str) -> bool:
        return identifier in self._embeddings

    def __len__(self) -> int:
        return len(self._embeddings)

    @property
    def num_bytes(self) -> int:
        """Bytes of the embeddings held: what the scheduler's ledger counts for them."""
        return sum(t.nbytes for t in self._embeddings.values())

    def get(self, identifier: str) -> torch.Tensor | None:
        return self._embeddings.get(identifier)

    def put(self, identifier: str, embeddings: torch.Tensor) -> None:
        """Keep `embeddings` [num_embeds, mm_embedding_width], moved to the model's device and
        dtype (a no-op for the vision tower's own output; the remote pool's may differ)."""
        self._embeddings[identifier] = embeddings.to(
            device=self.device, dtype=self.dtype
        ).contiguous()

    def free(self, identifiers: Iterable[str]) -> None:
        for identifier in identifiers:
            self._embeddings.pop(identifier, None)
