"""A processed prompt's items to and from the envelope's item parts; no torch on either side.

What remains of the converter: a prompt's items travel as specs plus their pixels once per
identifier (`WireMMFeature`, `WireEncoderInput`, `WireRemoteItem`). Every other value rides
in the envelopes as itself.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import NamedTuple

import numpy as np

from mmserve.multimodal import (
    MultiModalFeature,
    PlaceholderRange,
    ProcessedImage,
    ProcessedPrompt,
    RemoteItem,
)
from mmserve.sampling_params import SamplingParams
from mmserve.wire.common import WireEncoderInput, WireError, WireMMFeature, WireRemoteItem
from mmserve.wire.engine_core import EngineCoreRequest


class AddRequest(NamedTuple):
    """An EngineCoreRequest back in the engine's terms (the arguments of `add_request`)."""

    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    cache_salt: str | None
    eos_token_ids: tuple[int, ...] | None
    arrival_time_s: float


# ------------------------------------------------------------------ items and sampling


def feature_to_wire(f: MultiModalFeature) -> WireMMFeature:
    p = f.placeholder
    return WireMMFeature(f.identifier, f.modality, p.offset, p.length, f.grid_thw)


def encoder_input_to_wire(f: MultiModalFeature) -> WireEncoderInput | None:
    """The item's pixels for an encoder, or None when the feature holds none."""
    if not isinstance(f.data, ProcessedImage):
        return None  # no data, or a RemoteItem (`remote_item_to_wire`)
    data = f.data
    return WireEncoderInput(
        f.identifier, f.modality, data.grid_thw, data.pixel_values, data.second_per_grid_t
    )


def remote_item_to_wire(identifier: str, item: RemoteItem) -> WireRemoteItem:
    """The payload becomes a uint8 array over the same bytes (no copy): a raw frame."""
    payload = None if item.payload is None else np.frombuffer(item.payload, dtype=np.uint8)
    return WireRemoteItem(
        identifier,
        item.source,
        payload,
        item.url,
        item.rgb_size,
        item.min_pixels,
        item.max_pixels,
        item.grid_thw,
        item.content_digest,
    )


def remote_item_from_wire(w: WireRemoteItem) -> RemoteItem:
    """Raises WireError where the fields break RemoteItem's own rules."""
    try:
        return RemoteItem(
            source=w.source,
            payload=None if w.payload is None else w.payload.tobytes(),
            url=w.url,
            rgb_size=None if w.rgb_size is None else (w.rgb_size[0], w.rgb_size[1]),
            min_pixels=w.min_pixels,
            max_pixels=w.max_pixels,
            grid_thw=(w.grid_thw[0], w.grid_thw[1], w.grid_thw[2]),
            content_digest=w.content_digest,
        )
    except ValueError as e:
        raise WireError(f"remote item {w.identifier[:16]}: {e}") from None


def feature_from_wire(
    f: WireMMFeature, data: ProcessedImage | RemoteItem | None
) -> MultiModalFeature:
    placeholder = PlaceholderRange(f.offset, f.length)
    return MultiModalFeature(f.identifier, f.modality, placeholder, data, tuple(f.grid_thw))


def _pixels_by_identifier(items: Sequence[WireEncoderInput]) -> dict[str, ProcessedImage]:
    return {
        i.identifier: ProcessedImage(i.pixel_values, tuple(i.grid_thw), i.second_per_grid_t)
        for i in items
    }


# ------------------------------------------------------------ API <-> engine core


def request_to_wire(
    request_id: str,
    prompt: ProcessedPrompt,
    params: SamplingParams,
    *,
    arrival_time_s: float,
    cache_salt: str | None = None,
    eos_token_ids: tuple[int, ...] | None = None,
    held_identifiers: Container[str] = frozenset(),
) -> EngineCoreRequest:
    """Pixels (or a remote item's payload) go for every item that has them, once per
    identifier, except those the engine is known to hold (`held_identifiers`)."""
    encoder_inputs: dict[str, WireEncoderInput] = {}
    remote_items: dict[str, WireRemoteItem] = {}
    for f in prompt.mm_features:
        sent = f.identifier in encoder_inputs or f.identifier in remote_items
        if f.identifier in held_identifiers or sent:
            continue
        if isinstance(f.data, RemoteItem):
            remote_items[f.identifier] = remote_item_to_wire(f.identifier, f.data)
        elif (item := encoder_input_to_wire(f)) is not None:
            encoder_inputs[f.identifier] = item
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt.prompt_token_ids),
        mm_features=[feature_to_wire(f) for f in prompt.mm_features],
        encoder_inputs=list(encoder_inputs.values()),
        sampling_params=params,
        mrope_positions=prompt.mrope_positions,
        mrope_position_delta=prompt.mrope_position_delta,
        eos_token_ids=eos_token_ids,
        cache_salt=cache_salt,
        arrival_time_s=arrival_time_s,
        remote_items=list(remote_items.values()),
    )


def request_from_wire(msg: EngineCoreRequest) -> AddRequest:
    """Raises WireError for a remote item that breaks RemoteItem's rules."""
    data: dict[str, ProcessedImage | RemoteItem] = {
        w.identifier: remote_item_from_wire(w) for w in msg.remote_items
    }
    data.update(_pixels_by_identifier(msg.encoder_inputs))
    prompt = ProcessedPrompt(
        prompt_token_ids=msg.prompt_token_ids,
        mm_features=[feature_from_wire(f, data.get(f.identifier)) for f in msg.mm_features],
        mrope_positions=msg.mrope_positions,
        mrope_position_delta=msg.mrope_position_delta,
    )
    return AddRequest(
        msg.request_id,
        prompt,
        msg.sampling_params,
        msg.cache_salt,
        msg.eos_token_ids,
        msg.arrival_time_s,
    )
