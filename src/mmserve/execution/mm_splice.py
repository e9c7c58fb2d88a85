"""Which rows of a request's item embeddings go to which placeholder of a scheduled window."""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping

import torch

from mmserve.errors import FailureKind
from mmserve.execution.input_batch import SpliceError
from mmserve.execution.request_state import RequestState
from mmserve.multimodal import MultiModalFeature

# an item's embeddings [num_embeds, mm_embedding_width] from the encoder cache; None: missing
EmbeddingsOf = Callable[[MultiModalFeature], torch.Tensor | None]


def gather_mm_embeddings(
    state: RequestState,
    start: int,
    end: int,
    window_ids: list[int],
    embeddings_of: EmbeddingsOf,
    placeholder_token_ids: tuple[int, ...],
) -> tuple[list[int], list[torch.Tensor]]:
    """Slices of each item's embeddings that fall in [start, end), and where they go.

    Item at [offset, offset + length) vs. the scheduled window:

        tokens   ... | start ............................. end | ...
        item           | offset ........ offset+length |
        slice          emb[max(start,offset)-offset : min(end,offset+length)-offset]

    The rows gathered must equal the placeholder ids in the window, one for one.
    """
    local_index: list[int] = []
    parts: list[torch.Tensor] = []
    sizes: list[int] = []
    for feature in state.mm_features:
        lo = max(start, feature.placeholder.offset)
        hi = min(end, feature.placeholder.end)
        if lo >= hi:
            continue
        emb = embeddings_of(feature)
        if emb is None:
            raise SpliceError(
                f"encoder cache miss for item {feature.identifier[:16]} (a scheduler bug)",
                FailureKind.INTERNAL,
            )
        if emb.shape[0] != feature.placeholder.length:
            raise SpliceError(
                f"Attempted to assign {emb.shape[0]} multimodal tokens of item "
                f"{feature.identifier[:16]} to {feature.placeholder.length} placeholders"
            )
        parts.append(emb[lo - feature.placeholder.offset : hi - feature.placeholder.offset])
        sizes.append(hi - lo)
        local_index.extend(range(lo - start, hi - start))
    # Only prompt tokens can be placeholders: a generated token that happens to be a vision
    # id is ordinary text (the model produced it; there is no image behind it).
    num_prompt_in_window = max(0, min(end, state.payload.num_prompt_tokens) - start)
    placeholders = [
        i for i, t in enumerate(window_ids[:num_prompt_in_window]) if t in placeholder_token_ids
    ]
    if placeholders != local_index:
        expr = " + ".join(str(s) for s in sizes) or "0"
        raise SpliceError(
            f"Attempted to assign {expr} = {len(local_index)} multimodal tokens to "
            f"{len(placeholders)} placeholders"
        )
    return local_index, parts


def items_missing_in_windows(
    num_scheduled_tokens: Mapping[str, int],
    states: Mapping[str, RequestState],
    cached: Container[str],
) -> list[tuple[str, MultiModalFeature]]:
    """(request, item) pairs whose item this step's windows splice but `cached` lacks (and
    that are not remote): what the splice would have to encode on the spot."""
    missing: list[tuple[str, MultiModalFeature]] = []
    for request_id, num_tokens in num_scheduled_tokens.items():
        state = states[request_id]
        start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
        if start >= state.payload.num_prompt_tokens:  # decoding: no placeholder in its window
            continue
        for feature in state.mm_features:
            lo, hi = max(start, feature.placeholder.offset), min(end, feature.placeholder.end)
            if lo < hi and not feature.is_remote and feature.identifier not in cached:
                missing.append((request_id, feature))
    return missing
