"""Small real stand-ins for the scheduler's neighbours: request builders and a model runner that
keeps its own state from `SchedulerOutput` diffs and checks the contract on every step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.errors import FailureKind, RequestFailure
from mmserve.multimodal import MultiModalFeature, PlaceholderRange
from mmserve.scheduling import (
    EncoderCacheManager,
    KVCacheManager,
    ModelRunnerOutput,
    Request,
    Scheduler,
    SchedulerOutput,
)
from mmserve.scheduling.admission import validate_request
from mmserve.scheduling.outputs import GrammarOutput

IMAGE_PAD_ID = 151655


def make_scheduler(
    scheduler_config: SchedulerConfig, cache_config: CacheConfig, **kwargs
) -> Scheduler:
    """A scheduler with fresh managers built from the two configs (as the engine wires it)."""
    encoder_cache = EncoderCacheManager(
        scheduler_config.effective_encoder_cache_bytes, scheduler_config.encoder_embed_bytes
    )
    return Scheduler(
        scheduler_config, cache_config, KVCacheManager(cache_config), encoder_cache, **kwargs
    )


def admit(scheduler: Scheduler, request: Request) -> None:
    """What the front end does before a request reaches a scheduler: admission, then add."""
    validate_request(
        request.num_prompt_tokens,
        request.max_tokens,
        request.mm_features,
        scheduler.scheduler_config,
        scheduler.cache_config,
    )
    scheduler.add_request(request)


def image(identifier: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature(
        identifier=identifier,
        modality="image",
        placeholder=PlaceholderRange(offset, length),
        grid_thw=(1, 2, length * 2),
    )


def make_request(
    request_id: str,
    num_prompt_tokens: int,
    images: list[tuple[str, int, int]] = (),
    *,
    text_seed: int = 0,
    **kwargs,
) -> Request:
    """A prompt of `num_prompt_tokens` text ids (a function of position and `text_seed`) with
    image placeholder runs at the given (identifier, offset, length)."""
    tokens = [100 + (7 * i + text_seed) % 1000 for i in range(num_prompt_tokens)]
    features = []
    for identifier, offset, length in images:
        tokens[offset : offset + length] = [IMAGE_PAD_ID] * length
        features.append(image(identifier, offset, length))
    return Request(request_id, tokens, mm_features=features, **kwargs)


@dataclass
class _RunnerRequest:
    token_ids: list[int]
    mm_features: list[MultiModalFeature]
    block_ids: list[int]
    num_computed_tokens: int
    content: list[int] = field(default_factory=list)  # causal-prefix key per position


class FakeRunner:
    """Applies each step like a real runner and asserts what a real one would crash on.

    - encoder: frees first, then encodes each scheduled item (never one already resident, never
      over capacity); every item overlapping a request's window must be resident (else the
      real runner raises "Encoder cache miss").
    - KV: each slot stores a key of the whole causal prefix (tokens and image identities);
      a prefix-cache hit must find exactly its own keys in the blocks it was given.
    - sampling: one token (from `sample(request_id, position)`) per request whose step
      reaches the end of its tokens; requests in `fail_ids` get an error instead.
    - remote items: each one sent (`remote_encoder_inputs`) is pending, never sent twice while
      pending; a freed pending identifier is cancelled (`cancelled`). The test moves pending
      identifiers along with `deliver` (into the cache, reported arrived) and `fail_items`.
    """

    def __init__(
        self,
        encoder_cache_size: int,
        block_size: int,
        sample: Callable[[str, int], int] = lambda rid, pos: 7,
    ) -> None:
        self.encoder_cache_size = encoder_cache_size
        self.block_size = block_size
        self.sample = sample
        self.encoder_cache: dict[str, int] = {}
        self.kv: dict[int, list[int | None]] = {}
        self.requests: dict[str, _RunnerRequest] = {}
        self.fail_ids: set[str] = set()
        self.num_items_encoded = 0
        self.last_step_encoded_embeds = 0
        self.last_step_encoded_patches = 0
        self.remote_pending: dict[str, int] = {}  # identifier -> num_embeds
        self.num_remote_sent = 0
        self.cancelled: list[str] = []
        self.deliver: set[str] = set()  # delivered at the next step, if still pending
        self.fail_items: dict[str, RequestFailure] = {}
        self.failed_remote: set[str] = set()  # reported failed, not yet freed by the ledger

    def execute(
        self, out: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        assert grammar_output is None, "the fake runner samples no structured output"
        for request_id in out.finished_req_ids | out.preempted_req_ids:
            self.requests.pop(request_id, None)
        for identifier in out.free_encoder_identifiers:
            if identifier in self.remote_pending:
                del self.remote_pending[identifier]
                self.cancelled.append(identifier)
            elif identifier in self.failed_remote:
                self.failed_remote.discard(identifier)  # the ledger frees what failed
            else:
                del self.encoder_cache[identifier]
        for new in out.scheduled_new_reqs:
            assert new.request_id not in self.requests
            self.requests[new.request_id] = _RunnerRequest(
                list(new.token_ids), new.mm_features, list(new.block_ids), new.num_computed_tokens
            )
            self._check_prefix_hit(self.requests[new.request_id])
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            assert state.num_computed_tokens == cached.num_computed_tokens
            state.block_ids += cached.new_block_ids
        self._encode(out)
        arrived, failed = self._remote(out)
        sampled, errors = {}, {}
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.requests[request_id]
            self._run(state, num_tokens)
            if request_id in self.fail_ids:
                errors[request_id] = RequestFailure(
                    "Attempted to assign 4 multimodal tokens to 5 placeholders", FailureKind.REQUEST
                )
            elif state.num_computed_tokens == len(state.token_ids):
                token = self.sample(request_id, len(state.token_ids))
                state.token_ids.append(token)
                sampled[request_id] = [token]
        return ModelRunnerOutput(
            sampled_token_ids=sampled, errors=errors, encoder_arrived=arrived, encoder_failed=failed
        )

    def _remote(self, out: SchedulerOutput) -> tuple[list[str], dict[str, RequestFailure]]:
        for features in out.remote_encoder_inputs.values():
            for feature in features:
                assert feature.identifier not in self.remote_pending, "sent twice"
                assert feature.identifier not in self.encoder_cache, "sent a resident item"
                self.remote_pending[feature.identifier] = feature.num_embeds
                self.num_remote_sent += 1
        arrived = [i for i in sorted(self.deliver) if i in self.remote_pending]
        for identifier in arrived:
            self.encoder_cache[identifier] = self.remote_pending.pop(identifier)
        self.deliver -= set(arrived)
        failed = {i: f for i, f in self.fail_items.items() if i in self.remote_pending}
        for identifier in failed:
            del self.remote_pending[identifier]
            del self.fail_items[identifier]
            self.failed_remote.add(identifier)
        return arrived, failed

    def _encode(self, out: SchedulerOutput) -> None:
        self.last_step_encoded_embeds = 0
        self.last_step_encoded_patches = 0
        for request_id, item_idxs in out.scheduled_encoder_inputs.items():
            for item_idx in item_idxs:
                feature = self.requests[request_id].mm_features[item_idx]
                assert feature.identifier not in self.encoder_cache, "encoded twice"
                self.encoder_cache[feature.identifier] = feature.num_embeds
                self.num_items_encoded += 1
                self.last_step_encoded_embeds += feature.num_embeds
                self.last_step_encoded_patches += feature.num_patches
        in_use = sum(self.encoder_cache.values()) + sum(self.remote_pending.values())
        assert in_use <= self.encoder_cache_size

    def _content_keys(self, state: _RunnerRequest, end: int) -> None:
        while len(state.content) < end:
            pos = len(state.content)
            item = next(
                (
                    (f.identifier, pos - f.placeholder.offset)
                    for f in state.mm_features
                    if f.placeholder.offset <= pos < f.placeholder.end
                ),
                None,
            )
            prev = state.content[-1] if state.content else 0
            state.content.append(hash((prev, state.token_ids[pos], item)))

    def _check_prefix_hit(self, state: _RunnerRequest) -> None:
        self._content_keys(state, state.num_computed_tokens)
        for pos in range(state.num_computed_tokens):
            block = state.block_ids[pos // self.block_size]
            assert self.kv[block][pos % self.block_size] == state.content[pos], "wrong KV reused"

    def _run(self, state: _RunnerRequest, num_tokens: int) -> None:
        start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
        assert num_tokens > 0 and end <= len(state.token_ids)
        assert len(state.block_ids) * self.block_size >= end, "KV slots missing"
        for f in state.mm_features:
            if f.placeholder.offset < end and f.placeholder.end > start:
                assert f.identifier in self.encoder_cache, f"Encoder cache miss for {f.identifier}"
        self._content_keys(state, end)
        for pos in range(start, end):
            slots = self.kv.setdefault(
                state.block_ids[pos // self.block_size], [None] * self.block_size
            )
            slots[pos % self.block_size] = state.content[pos]
        state.num_computed_tokens = end


def run_step(scheduler: Scheduler, runner: FakeRunner):
    """schedule -> execute -> update, checking both managers; returns (output, updates)."""
    out = scheduler.schedule()
    updates = scheduler.update_from_output(out, runner.execute(out))
    scheduler.check_integrity()
    return out, updates
