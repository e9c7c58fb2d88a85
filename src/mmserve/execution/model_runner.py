"""Executes one SchedulerOutput: encoder items, the splice, the LM forward, sampling.

Over a tensor-parallel group every rank runs a ModelRunner on the same SchedulerOutputs: the
same states, the same encoder cache (encoder/step.py), the same forward (its layers
all-reduce); the first rank samples and broadcasts the tokens (sample/broadcast.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from mmserve.config.scheduler import SchedulerConfig
from mmserve.errors import FailureKind, RequestFailure
from mmserve.execution.encoder.intake import RemoteItemIntake, RemoteResults
from mmserve.execution.encoder.pixels import ItemDataStore
from mmserve.execution.encoder.runner import EncodeJob, EncoderRunner
from mmserve.execution.encoder.source import EncoderSource
from mmserve.execution.encoder.step import StepEncoder
from mmserve.execution.graphs.capture import GraphFactory
from mmserve.execution.graphs.decode import DecodeGraphs
from mmserve.execution.input_batch import InputBuffers, SpliceError, StepBatch, prepare_batch
from mmserve.execution.lm_threads import LMThreads, lm_macs_per_token
from mmserve.execution.mm_splice import gather_mm_embeddings, items_missing_in_windows
from mmserve.execution.request_state import RequestState, RunnerPayload
from mmserve.execution.sample.bitmask import sampling_bitmask
from mmserve.execution.sample.broadcast import broadcast_tokens
from mmserve.execution.sample.prompt_logprobs import add_window_rows, take_prompt_logprobs
from mmserve.execution.sample.rows import SamplingRow
from mmserve.execution.sample.sampler import make_device_generator
from mmserve.execution.sample.step import sample_step
from mmserve.layers.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from mmserve.layers.attention.buffers import BatchLimits
from mmserve.layers.parallel import SINGLE, TPGroup
from mmserve.multimodal import EncoderInput, ItemData, MultiModalFeature
from mmserve.scheduling.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from mmserve.updates import Logprobs

logger = logging.getLogger(__name__)


def _default_limits() -> BatchLimits:
    """Buffers of a runner built without limits (tests): the scheduler's default budgets;
    grown past by falling back to exact ones."""
    budgets = SchedulerConfig()
    return BatchLimits(
        max_num_tokens=budgets.max_num_batched_tokens,
        max_num_seqs=budgets.max_num_seqs,
        max_blocks_per_seq=512,
    )


class ModelRunner:
    """Holds per-request state, the KV caches and the encoder cache of one model (of one
    tensor-parallel rank's shard of it).

    With `tp` of size N, N runners (one per rank, each in its worker process) execute every
    step alike; only the first rank's `ModelRunnerOutput` is the executor's answer: it alone
    samples (with its generator, the grammar masks, penalties and logprobs) and sends the
    tokens to the others, whose outputs carry the same tokens but no logprobs, and whose
    failures repeat the first rank's decisions (messages aside). Every per-request decision
    (a bad item, a count mismatch, a sampling failure) is taken alike on every rank, from
    identical inputs or by an exchange, so the ranks' states never diverge.
    """

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
        limits: BatchLimits | None = None,
        encoder_source: EncoderSource | None = None,
        item_data: ItemDataStore | None = None,
        tp: TPGroup = SINGLE,
        mm_encoder_tp_mode: str = "data",
        lm_threads: LMThreads | None = None,
    ) -> None:
        """`encoder_source` encodes remote items (a disaggregated server); without one a
        remote item fails its requests. `item_data` holds the items' pixels (see
        encoder/pixels.py); None: one that keeps nothing for a re-encode. `tp`: this rank's
        group, the model built for it; `mm_encoder_tp_mode`: "data" (a replicated tower, the
        step's items split across the ranks) or "weights" (a sharded tower: every rank
        encodes every item); see encoder/step.py. `lm_threads`: the CPU thread policy of the
        language model's work (lm_threads.py; by default the model's own)."""
        if tp.size > 1 and encoder_source is not None:
            raise ValueError(
                "--encoder-urls cannot be combined with --tensor-parallel-size > 1: the remote "
                "encoder pool feeds one runner; run the language model on one device per "
                "server, or encode locally"
            )
        self.model = model
        self.kv_caches = kv_caches
        self.encoder = encoder_runner
        self.encoder_cache = encoder_runner.cache
        self.tp = tp
        self.step_encoder = StepEncoder(
            tp=tp,
            mode=mm_encoder_tp_mode,
            embedding_width=model.config.mm_embedding_width if tp.size > 1 else 0,
        )
        self.block_size = block_size
        self.placeholder_token_ids = placeholder_token_ids
        self.device = device
        self.attention_backend = attention_backend or TorchAttentionBackend()
        # on a CPU, a small step's language model on one thread (lm_threads.py)
        self.lm_threads = lm_threads or LMThreads(device, lm_macs_per_token(model))
        self.states: dict[str, RequestState] = {}
        # the engine's generator, on the device: unseeded rows draw their noise from it
        self._generator = make_device_generator(seed, device)
        self.buffers = InputBuffers(limits or _default_limits(), device)
        self.decode_graphs: DecodeGraphs | None = None
        self.encoder_source = encoder_source
        # an item's encoder output rows: [num_embeds, mm_embedding_width] (the main embedding
        # then every DeepStack level); they reach the model's splice at this width, unsplit
        width = model.config.mm_embedding_width if encoder_source is not None else 0
        self.remote = RemoteItemIntake(encoder_source, encoder_runner, width)
        self.item_data = item_data if item_data is not None else ItemDataStore(capacity_bytes=0)

    def add_mm_data(self, request_id: str, data: Mapping[str, ItemData]) -> None:
        """A new request's item data (pixels or remote items), by identifier."""
        self.item_data.add(request_id, data)

    def free_mm_data(self, request_ids: Iterable[str]) -> None:
        """The requests are finished: what only they held of item data goes."""
        self.item_data.release(request_ids)

    @torch.inference_mode()
    def execute(
        self, so: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        """`grammar_output` masks what the structured requests may sample (the engine core
        computes it after scheduling)."""
        output = self._execute(so, grammar_output)
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            state = self.states.get(request_id)
            if state is not None:  # its data waits, bounded, in case of a preemption
                end = state.num_computed_tokens + num_tokens
                self.item_data.pass_items(request_id, state.mm_features, end)
        return output

    def _execute(
        self, so: SchedulerOutput, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput:
        self._update_states(so)
        not_sent = self.remote.submit(so.remote_encoder_inputs, self.item_data.get)
        collected = self.remote.collect()
        results = RemoteResults(collected.arrived, {**collected.failed, **not_sent})
        errors: dict[str, RequestFailure] = {}
        self._encode(so, errors)
        if so.total_num_scheduled_tokens == 0:
            return _output({}, errors, {}, results)
        self.buffers.wait_until_sent()
        batch = prepare_batch(
            so,
            self.states,
            errors,
            self._gather_mm_embeddings,
            self.buffers,
            self.attention_backend,
            self.block_size,
        )
        self.buffers.mark_sent()
        if batch is None:
            return _output({}, errors, {}, results)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, Logprobs] = {}
        with self.lm_threads.step(batch.num_tokens):
            hidden = self.decode_graphs.run(batch) if self.decode_graphs is not None else None
            if hidden is None:
                hidden = self._forward(
                    batch.input_ids,
                    batch.positions,
                    batch.attn_metadata,
                    batch.mm_index,
                    batch.mm_embeds,
                )
            add_window_rows(self.model.compute_logits, hidden, batch.request_ids, so, self.states)
            if batch.sample_request_ids:
                self._sample(batch, hidden, grammar_output, errors, sampled, logprobs)
        output = _output(sampled, errors, logprobs, results)
        for request_id in sampled:  # the prompt's rows go with the first token
            rows = take_prompt_logprobs(self.model.compute_logits, self.states[request_id])
            if rows is not None:
                output.prompt_logprobs[request_id] = rows
        return output

    def wait_for_encoder(self, timeout_s: float) -> None:
        """Block until the encoder source has something for an item in flight, or timeout."""
        self.remote.wait(timeout_s)

    def capture_decode_graphs(self, sizes: Sequence[int], factory: GraphFactory) -> float:
        """Capture decode graphs of these batch sizes; seconds taken. `factory` makes each
        graph: CUDA graphs on the GPU, `eager_graph_factory` in tests. ValueError when the
        attention backend cannot be captured."""
        graphs = DecodeGraphs(
            sizes,
            self.buffers.limits.max_blocks_per_seq,
            self.attention_backend,
            self.block_size,
            self.device,
        )
        with torch.inference_mode():
            seconds = graphs.capture(self._forward, factory)
        self.decode_graphs = graphs
        return seconds

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        mm_index: torch.Tensor | None = None,
        mm_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden]: embeddings (images spliced in), the decoder."""
        embeds = self.model.embed_input_ids(input_ids, mm_embeds, mm_index)  # [num_tokens, hidden]
        return self.model(None, positions, attn_metadata, self.kv_caches, inputs_embeds=embeds)

    def _sample(
        self,
        batch: StepBatch,
        hidden: torch.Tensor,
        grammar_output: GrammarOutput | None,
        errors: dict[str, RequestFailure],
        sampled: dict[str, list[int]],
        logprobs: dict[str, Logprobs],
    ) -> None:
        # every rank computes the logits: a vocab-parallel head gathers them over the group
        logits = self.model.compute_logits(hidden[batch.sample_rows])  # [num_samples, vocab]
        tokens: list[int | RequestFailure] | None = None
        step_logprobs: dict[int, Logprobs] = {}
        if self.tp.is_first:
            rows = [self._sampling_row(self.states[r]) for r in batch.sample_request_ids]
            bitmask = sampling_bitmask(grammar_output, batch.sample_request_ids)
            step = sample_step(logits, rows, self._generator, bitmask)  # the one host sync
            tokens, step_logprobs = step.tokens, step.logprobs
        if self.tp.size > 1:
            tokens = broadcast_tokens(self.tp, tokens, len(batch.sample_request_ids), self.device)
        assert tokens is not None
        for i, (request_id, token) in enumerate(zip(batch.sample_request_ids, tokens, strict=True)):
            if isinstance(token, RequestFailure):
                errors[request_id] = token
                if token.kind is FailureKind.INTERNAL:  # its KV may hold NaN
                    self._scrub_kv(self.states[request_id])
                continue
            self.states[request_id].token_ids.append(token)
            sampled[request_id] = [token]
            if i in step_logprobs:
                logprobs[request_id] = step_logprobs[i]

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
        self.remote.cancel(so.free_encoder_identifiers)  # those still in flight
        self.encoder_cache.free(so.free_encoder_identifiers)
        for new in so.scheduled_new_reqs:
            payload = new.payload
            assert isinstance(payload, RunnerPayload), type(payload)
            # Prompt logprobs once, from a fresh prefill: the scheduler never lends such a
            # request cached blocks, and a resumed one (tokens past its prompt) sent them.
            wants = payload.sampling_params.prompt_logprobs is not None and (
                len(new.token_ids) == payload.num_prompt_tokens
            )
            assert not wants or new.num_computed_tokens == 0, "prompt logprobs need a full prefill"
            self.states[new.request_id] = RequestState(
                new.request_id,
                list(new.token_ids),
                list(new.mm_features),
                list(new.block_ids),
                new.num_computed_tokens,
                payload,
                first_own_block_idx=new.num_computed_tokens // self.block_size,
                prompt_logprob_chunks=[] if wants else None,
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
            state.num_output_tokens,
            p.eos_token_ids,
            state.token_ids,
        )

    # -------------------------------------------------------------------------- encoder

    def _encode(self, so: SchedulerOutput, errors: dict[str, RequestFailure]) -> None:
        """Run every scheduled item through the vision tower in as few calls as possible."""
        features = [
            (request_id, self._with_pixels(self.states[request_id].mm_features[i]))
            for request_id, item_idxs in so.scheduled_encoder_inputs.items()
            for i in item_idxs
        ]
        if self.tp.size > 1:
            # NOTE: the splice encodes an item missing from the cache on the spot (see
            # `_embeddings`); over a group that is a group decision (a failure on one rank
            # fails the request on all, a sharded tower needs every rank): taken here.
            missing = items_missing_in_windows(
                so.num_scheduled_tokens, self.states, self.encoder_cache
            )
            jobs = [(request_id, self._with_pixels(f)) for request_id, f in missing]
            features += [(request_id, job) for request_id, job in jobs if job.pixels is not None]
        self.step_encoder.encode(self.encoder, features, errors)

    def _with_pixels(self, feature: MultiModalFeature) -> EncodeJob:
        """The item and its pixels; None pixels when they are gone (a bug: the scheduler asks
        the store before it schedules a re-encode), which fails the item's request."""
        data = self.item_data.get(feature.identifier)
        return EncodeJob(feature, data if isinstance(data, EncoderInput) else None)

    # ----------------------------------------------------------------------------- splice

    def _gather_mm_embeddings(
        self, state: RequestState, start: int, end: int, window_ids: list[int]
    ) -> tuple[list[int], list[torch.Tensor]]:
        return gather_mm_embeddings(
            state, start, end, window_ids, self._embeddings, self.placeholder_token_ids
        )

    def _embeddings(self, feature: MultiModalFeature) -> torch.Tensor | None:
        """The item's embeddings from the encoder cache, encoding it now if it is missing.

        NOTE: an item whose encoding failed (failing its request) still counts as resident in
        the scheduler, so a later request with the same picture is not scheduled to encode
        it. Encoding it here keeps one failure from failing every later request that shares
        the item; the scheduler frees the entry as usual.
        """
        emb = self.encoder_cache.get(feature.identifier)
        if emb is not None or feature.is_remote:
            return emb
        job = self._with_pixels(feature)
        if job.pixels is None:
            return None
        logger.warning(
            "item %s is not in the encoder cache; encoding it now", feature.identifier[:16]
        )
        try:
            self.encoder.encode([job])
        except Exception as exc:  # noqa: BLE001 - fails the request that needs the item
            raise SpliceError(
                f"encoding multimodal item failed: {type(exc).__name__}", FailureKind.INTERNAL
            ) from exc
        return self.encoder_cache.get(feature.identifier)


def _output(
    sampled: dict[str, list[int]],
    errors: dict[str, RequestFailure],
    logprobs: dict[str, Logprobs],
    remote: RemoteResults,
) -> ModelRunnerOutput:
    return ModelRunnerOutput(sampled, errors, logprobs, remote.arrived, remote.failed)
