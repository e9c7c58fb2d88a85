"""Runs scheduled multimodal items through the vision tower, into the encoder cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from mmserve.execution.encoder.cache import EncoderCache
from mmserve.execution.encoder.normalize import PixelNormalizer
from mmserve.metrics import EngineMetrics
from mmserve.multimodal import EncoderInput, MultiModalFeature


class EncodeJob(NamedTuple):
    """One item to encode: its spec and its pixels (None when they are gone: an error)."""

    feature: MultiModalFeature
    pixels: EncoderInput | None


# embed_multimodal(pixel_values [total_patches, C*T*P*P], grid_thw)
#   -> one [n_i, mm_embedding_width] per item (the main embedding, then each DeepStack level)
EmbedFn = Callable[[torch.Tensor, list[tuple[int, int, int]]], list[torch.Tensor]]


class EncoderRunner:
    """Encodes the items the scheduler names, in as few vision-tower calls as its budget
    allows, and keeps their embeddings in `cache` (which it never evicts from)."""

    def __init__(
        self,
        embed: EmbedFn,
        cache: EncoderCache,
        *,
        max_patches_per_call: int,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self._embed = embed
        self.cache = cache
        self._max_patches_per_call = max(1, max_patches_per_call)
        self._metrics = metrics
        # one caller, which drops the pixels once the tower has run: the output can be reused
        self._normalize = PixelNormalizer(cache.device, cache.dtype, reuse_output=True)

    def encode(self, jobs: Sequence[EncodeJob]) -> None:
        """Encode every item not already cached, deduplicated by identifier.

        Items are grouped by modality (a batch never mixes modalities), then packed into calls
        of at most `max_patches_per_call` input patches (one item larger than that runs alone).
        """
        todo: dict[str, EncodeJob] = {}
        for job in jobs:
            identifier = job.feature.identifier
            if identifier not in self.cache and identifier not in todo:
                if job.pixels is None:
                    raise RuntimeError(
                        f"encoder input for item {identifier[:16]} has no pixels to encode"
                    )
                todo[identifier] = job
        by_modality: dict[str, list[EncodeJob]] = {}
        for job in todo.values():
            by_modality.setdefault(job.feature.modality, []).append(job)
        for group in by_modality.values():
            for batch in self._pack(group):
                self._run(batch)

    def count_encoded(self, jobs: Sequence[EncodeJob]) -> None:
        """Count items other tensor-parallel ranks ran through the tower for this group (data
        mode: the first rank's metrics speak for the group, each item once)."""
        if self._metrics is None:
            return
        for job in jobs:
            self._metrics.inc("encoder_items_encoded", modality=job.feature.modality)

    def _pack(self, group: list[EncodeJob]) -> list[list[EncodeJob]]:
        batches: list[list[EncodeJob]] = []
        current: list[EncodeJob] = []
        patches = 0
        for job in group:
            n = job.feature.num_patches
            if current and patches + n > self._max_patches_per_call:
                batches.append(current)
                current, patches = [], 0
            current.append(job)
            patches += n
        if current:
            batches.append(current)
        return batches

    def _run(self, batch: list[EncodeJob]) -> None:
        pixels_of = [job.pixels for job in batch if job.pixels is not None]  # all, see encode
        # uint8 levels -> [total_patches, C * T * P * P] in the tower's dtype, on its device
        pixels = self._normalize(pixels_of)
        grids = [p.grid_thw for p in pixels_of]
        outputs = self._embed(pixels, grids)
        for job, emb in zip(batch, outputs, strict=True):
            self.cache.put(job.feature.identifier, emb)
        if self._metrics is not None:
            modality = batch[0].feature.modality  # a batch never mixes modalities
            self._metrics.inc("encoder_items_encoded", len(batch), modality=modality)
            self._metrics.inc("encoder_forward_calls", modality=modality)
