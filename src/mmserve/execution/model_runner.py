"""Executes one SchedulerOutput: encoder items, the splice, the LM forward, sampling."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mmserve.errors import FailureKind, RequestFailure
from mmserve.execution.encoder_runner import EncoderRunner
from mmserve.execution.logprobs import gather_logprobs, raw_logprobs
from mmserve.execution.request_state import RequestState, RunnerPayload
from mmserve.execution.sampler import SamplingRow, make_generator, sample
from mmserve.execution.token_bitmask import sampling_bitmask
from mmserve.layers.attention import AttentionBackend, TorchAttentionBackend
from mmserve.multimodal import MultiModalFeature, ProcessedImage
from mmserve.scheduling.outputs import Logprobs, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Batch:
    """The flat token batch of one step (requests in scheduling order)."""

    request_ids: list[str]
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [3, num_tokens]
    mm_index: torch.Tensor  # [num_mm_tokens] flat indices of placeholder tokens
    mm_embeds: torch.Tensor | None  # [num_mm_tokens, hidden]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # flat index of the last token of each request that samples
    sample_request_ids: list[str]


class ModelRunner:
    """Holds per-request state, the KV caches and the encoder cache of one model."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        encoder_runner: EncoderRunner,
        *,
        block_size: int,
        placeholder_token_ids: tuple[int, ...],
        device: torch.device,
        seed: int = 0,
        attention_backend: AttentionBackend | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.encoder = encoder_runner
        self.block_size = block_size
        self.placeholder_token_ids = placeholder_token_ids
        self.device = device
        self.attention_backend = attention_backend or TorchAttentionBackend()
        self.states: dict[str, RequestState] = {}
        self._generator = make_generator(seed)

    @torch.inference_mode()
    def execute(
        self, so: SchedulerOutput, encoder_inputs: Mapping[str, ProcessedImage] | None = None
    ) -> ModelRunnerOutput:
        """`encoder_inputs` (by identifier) gives the pixels of items whose features hold none:
        a step decoded from the wire sends them only on the step that encodes them."""
        self._update_states(so)
        errors: dict[str, RequestFailure] = {}
        self._encode(so, errors, encoder_inputs or {})
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput({}, errors)
        batch = self._prepare_batch(so, errors)
        if not batch.request_ids:
            return ModelRunnerOutput({}, errors)
        # Once per step, before the forward: every layer reads this one metadata.
        attn_metadata = self.attention_backend.build_metadata(
            batch.query_lens, batch.seq_lens, batch.block_tables, self.block_size, self.device
        )
        embeds = self.model.embed_input_ids(batch.input_ids)  # [num_tokens, hidden]
        if batch.mm_embeds is not None:
            embeds[batch.mm_index] = batch.mm_embeds.to(embeds.dtype)
        hidden = self.model(
            None, batch.positions, attn_metadata, self.kv_caches, inputs_embeds=embeds
        )
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, Logprobs] = {}
        if batch.sample_rows:
            logits = self.model.compute_logits(hidden[batch.sample_rows])  # [num_samples, vocab]
            rows = [self._sampling_row(self.states[r]) for r in batch.sample_request_ids]
            raw = raw_logprobs(logits, rows)  # before sample() touches the logits
            bitmask = sampling_bitmask(so.grammar_bitmask, batch.sample_request_ids)
            tokens = sample(logits, rows, self._generator, token_bitmask=bitmask)
            by_row = gather_logprobs(raw, tokens) if raw is not None else {}
            for i, (request_id, token) in enumerate(
                zip(batch.sample_request_ids, tokens, strict=True)
            ):
                if isinstance(token, RequestFailure):
                    errors[request_id] = token
                    if token.kind is FailureKind.INTERNAL:  # its KV may hold NaN
                        self._scrub_kv(self.states[request_id])
                    continue
                self.states[request_id].token_ids.append(token)
                sampled[request_id] = [token]
                if i in by_row:
                    logprobs[request_id] = by_row[i]
        return ModelRunnerOutput(sampled, errors, logprobs)

    def _scrub_kv(self, state: RequestState) -> None:
        """Zero the KV blocks a failed request wrote itself.

        NOTE: NaN left in a freed block reaches its next owners: decode attention reads whole
        blocks (and pads block tables with block 0) and masks the slots past each sequence's
        length, but a masked weight of 0 times a NaN value is still NaN. Blocks the request
        got from the prefix cache are shared and were written by others: left alone.
        """
        own = state.block_ids[state.first_own_block_idx :]
        if own:
            idx = torch.tensor(own, dtype=torch.long, device=self.device)
            for kv_cache in self.kv_caches:  # [2, num_blocks, block_size, kv_heads, head_dim]
                kv_cache[:, idx] = 0

    def check_device(self) -> None:
        """Raise if the device can no longer compute: after a CUDA error every later call
        fails, so a failed step followed by a failed probe means the engine is done for."""
        probe = torch.ones(1, device=self.device) + 1  # [1]
        if probe.item() != 2.0:
            raise RuntimeError(f"device {self.device} computed 1 + 1 = {probe.item()}")

    # ---------------------------------------------------------------------------- state

    def _update_states(self, so: SchedulerOutput) -> None:
        for request_id in so.finished_req_ids | so.preempted_req_ids:
            self.states.pop(request_id, None)
        self.encoder.free(so.free_encoder_identifiers)
        for new in so.scheduled_new_reqs:
            payload = new.payload
            assert isinstance(payload, RunnerPayload), type(payload)
            self.states[new.request_id] = RequestState(
                new.request_id,
                list(new.token_ids),
                list(new.mm_features),
                list(new.block_ids),
                new.num_computed_tokens,
                payload,
                first_own_block_idx=new.num_computed_tokens // self.block_size,
            )
        for cached in so.scheduled_cached_reqs:
            state = self.states[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _sampling_row(self, state: RequestState) -> SamplingRow:
        p = state.payload
        return SamplingRow(
            state.request_id,
            p.sampling_params,
            p.generator,
            state.num_output_tokens,
            p.eos_token_ids,
            state.token_ids,
        )

    # -------------------------------------------------------------------------- encoder

    def _encode(
        self,
        so: SchedulerOutput,
        errors: dict[str, RequestFailure],
        encoder_inputs: Mapping[str, ProcessedImage],
    ) -> None:
        """Run every scheduled item through the vision tower in as few calls as possible."""
        features = [
            (request_id, _with_pixels(self.states[request_id].mm_features[i], encoder_inputs))
            for request_id, item_idxs in so.scheduled_encoder_inputs.items()
            for i in item_idxs
        ]
        if not features:
            return
        try:
            self.encoder.encode([f for _, f in features])
            self._drop_encoded_pixels(so)
        except Exception as exc:  # noqa: BLE001 - the retry below finds the item at fault
            # One bad item must fail only its own request: retry item by item. The traceback
            # is logged once, by the item that fails again.
            logger.warning("batched encoder call failed (%s); retrying item by item", exc)
            for request_id, feature in features:
                try:
                    self.encoder.encode([feature])
                except Exception as item_exc:  # noqa: BLE001 - reported to that request only
                    logger.exception("request %s: encoding a multimodal item failed", request_id)
                    errors[request_id] = RequestFailure(
                        f"encoding multimodal item failed: {type(item_exc).__name__}",
                        FailureKind.INTERNAL,
                    )

    def _drop_encoded_pixels(self, so: SchedulerOutput) -> None:
        """An encoded item's embeddings are in the encoder cache: the request's state needs
        its pixels no more (a preempted request comes back with them, from the scheduler)."""
        for request_id, item_idxs in so.scheduled_encoder_inputs.items():
            features = self.states[request_id].mm_features
            for i in item_idxs:
                if features[i].data is not None:
                    features[i] = dataclasses.replace(features[i], data=None)

    # ----------------------------------------------------------------------------- batch

    def _prepare_batch(self, so: SchedulerOutput, errors: dict[str, RequestFailure]) -> _Batch:
        ids: list[int] = []
        positions: list[np.ndarray] = []
        mm_index: list[int] = []
        mm_parts: list[torch.Tensor] = []
        b = _Batch([], torch.empty(0), torch.empty(0), torch.empty(0), None, [], [], [], [], [])
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            if request_id in errors:
                continue
            state = self.states[request_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
            window_ids = state.token_ids[start:end]
            try:
                local_index, parts = self._gather_mm_embeddings(state, start, end, window_ids)
            except _SpliceError as exc:
                if exc.kind is FailureKind.INTERNAL:
                    logger.error("request %s: %s", request_id, exc, exc_info=exc.__cause__)
                errors[request_id] = RequestFailure(str(exc), exc.kind)
                continue
            offset = len(ids)
            ids.extend(window_ids)
            positions.append(state.positions(start, end))
            mm_index.extend(offset + i for i in local_index)
            mm_parts.extend(parts)
            b.request_ids.append(request_id)
            b.query_lens.append(num_tokens)
            b.seq_lens.append(end)
            b.block_tables.append(state.block_ids)
            if end >= len(state.token_ids):
                b.sample_rows.append(len(ids) - 1)
                b.sample_request_ids.append(request_id)
        return _Batch(
            b.request_ids,
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.from_numpy(np.concatenate(positions, axis=1) if positions else np.zeros((3, 0)))
            .to(torch.long)
            .to(self.device),
            torch.tensor(mm_index, dtype=torch.long, device=self.device),
            torch.cat(mm_parts) if mm_parts else None,
            b.query_lens,
            b.seq_lens,
            b.block_tables,
            b.sample_rows,
            b.sample_request_ids,
        )

    def _gather_mm_embeddings(
        self, state: RequestState, start: int, end: int, window_ids: list[int]
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
            emb = self._embeddings(feature)
            if emb is None:
                raise _SpliceError(
                    f"encoder cache miss for item {feature.identifier[:16]} (a scheduler bug)",
                    FailureKind.INTERNAL,
                )
            if emb.shape[0] != feature.placeholder.length:
                raise _SpliceError(
                    f"Attempted to assign {emb.shape[0]} = {emb.shape[0]} multimodal tokens to "
                    f"{feature.placeholder.length} placeholders"
                )
            parts.append(emb[lo - feature.placeholder.offset : hi - feature.placeholder.offset])
            sizes.append(hi - lo)
            local_index.extend(range(lo - start, hi - start))
        # Only prompt tokens can be placeholders: a generated token that happens to be a vision
        # id is ordinary text (the model produced it; there is no image behind it).
        num_prompt_in_window = max(0, min(end, state.payload.num_prompt_tokens) - start)
        placeholders = [
            i
            for i, t in enumerate(window_ids[:num_prompt_in_window])
            if t in self.placeholder_token_ids
        ]
        if placeholders != local_index:
            expr = " + ".join(str(s) for s in sizes) or "0"
            raise _SpliceError(
                f"Attempted to assign {expr} = {len(local_index)} multimodal tokens to "
                f"{len(placeholders)} placeholders"
            )
        return local_index, parts

    def _embeddings(self, feature: MultiModalFeature) -> torch.Tensor | None:
        """The item's embeddings from the encoder cache, encoding it now if it is missing.

        NOTE: an item whose encoding failed (failing its request) still counts as resident in
        the scheduler, so a later request with the same picture is not scheduled to encode
        it. Encoding it here keeps one failure from failing every later request that shares
        the item; the scheduler frees the entry as usual.
        """
        emb = self.encoder.get(feature.identifier)
        if emb is not None or feature.data is None:
            return emb
        logger.warning(
            "item %s is not in the encoder cache; encoding it now", feature.identifier[:16]
        )
        try:
            self.encoder.encode([feature])
        except Exception as exc:  # noqa: BLE001 - fails the request that needs the item
            raise _SpliceError(
                f"encoding multimodal item failed: {type(exc).__name__}", FailureKind.INTERNAL
            ) from exc
        return self.encoder.get(feature.identifier)


def _with_pixels(
    feature: MultiModalFeature, encoder_inputs: Mapping[str, ProcessedImage]
) -> MultiModalFeature:
    """The feature with its pixels for this step only: the state keeps none it was not sent
    with, so pixels are not held for the whole decode."""
    data = encoder_inputs.get(feature.identifier)
    if feature.data is not None or data is None:
        return feature
    return dataclasses.replace(feature, data=data)


class _SpliceError(Exception):
    """The embeddings of a request do not match its placeholders; fails that request only.

    REQUEST when the prompt's own placeholders disagree with its items, INTERNAL when the
    runner lost what the scheduler said it holds.
    """

    def __init__(self, message: str, kind: FailureKind = FailureKind.REQUEST) -> None:
        super().__init__(message)
        self.kind = kind
