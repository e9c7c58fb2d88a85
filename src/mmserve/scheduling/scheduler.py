"""Continuous-batching FCFS scheduler: one token budget, one encoder budget, paged KV.

The window/item arithmetic each step applies is drawn in encoder_planner.py.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.errors import RequestFailure
from mmserve.scheduling.encoder_cache_manager import EncoderCacheManager
from mmserve.scheduling.encoder_planner import (
    EncoderPlan,
    free_consumed_encoder_inputs,
    plan_encoder_inputs,
    reserve_encoder_inputs,
)
from mmserve.scheduling.item_data import ItemDataHolder, PixelsGone
from mmserve.scheduling.kv_cache_manager import KVCacheManager
from mmserve.scheduling.outputs import ModelRunnerOutput, SchedulerOutput, SchedulerStats
from mmserve.scheduling.request import Request, check_stop
from mmserve.scheduling.step_plan import StepPlan
from mmserve.updates import RequestStatus, RequestUpdate

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides, each step, which requests run how many tokens and which items get encoded."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_manager: KVCacheManager,
        encoder_cache_manager: EncoderCacheManager,
        *,
        item_data: ItemDataHolder | None = None,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """The managers are built by the caller (`engine.core.build`) from the same configs.
        `item_data`: the executor side's store of the items' pixels (the request holds only
        specs), asked whether a passed item can be encoded again after a preemption; None:
        every item can (its pixels stay until the request finishes). `clock` stamps each
        request's first schedule (the queue-time metric):
        the front end's clock, `time.monotonic`."""
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.eos_token_ids = tuple(eos_token_ids)
        self.kv_cache_manager = kv_cache_manager
        self.encoder_cache_manager = encoder_cache_manager
        self.item_data = item_data
        self.requests: dict[str, Request] = {}  # unfinished only
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_req_ids: set[str] = set()
        self._failed_at_schedule: list[RequestUpdate] = []
        self._clock = clock
        self.num_preemptions = 0  # since start, over all requests

    # ----------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a request the front end admitted (`scheduling.admission`: it can run)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish (abort, stop string, ...) requests now: blocks and encoder references are
        released in this call. Unknown or already finished ids are ignored."""
        assert status.is_finished, status
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        finishing = [self.requests[i] for i in ids if i in self.requests]
        if not finishing:
            return
        self.running = [r for r in self.running if r.request_id not in ids]
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        for request in finishing:
            request.status = status
            self._release(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def make_stats(self) -> SchedulerStats:
        kv, enc = self.kv_cache_manager, self.encoder_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_kv_blocks=kv.num_free_blocks,
            encoder_cache_used_slots=enc.num_referenced_slots,
            encoder_cache_used_bytes=enc.num_referenced_bytes,
            encoder_cache_resident_slots=enc.num_used_slots,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            encoder_cache_queries=enc.queries,
            encoder_cache_hits=enc.hits,
            encoder_inflight_items=len(enc.inflight),
            encoder_inflight_bytes=enc.num_inflight_bytes,
            encoder_pool_bytes=enc.num_pool_bytes,
        )

    def check_integrity(self) -> None:
        self.kv_cache_manager.check_integrity()
        self.encoder_cache_manager.check_integrity()
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not self.kv_cache_manager.block_ids(request.request_id)
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert len(self.running) + len(self.waiting) == len(self.requests)

    # ----------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first (decodes and unfinished prefills, in arrival
        order), then waiting ones while token budget, `max_num_seqs` and KV blocks last."""
        config = self.scheduler_config
        step = StepPlan(
            config.max_num_batched_tokens, config.effective_encoder_patch_budget, self._clock()
        )
        self._schedule_running(step)
        # NOTE: a step that had to preempt admits nobody: the pool is known to be short.
        if not step.preempted:
            self._schedule_waiting(step)
        finished, self._finished_req_ids = self._finished_req_ids, set()
        return step.to_output(self.encoder_cache_manager.get_freed_identifiers(), finished)

    def _schedule_running(self, step: StepPlan) -> None:
        req_idx = 0
        while req_idx < len(self.running) and step.token_budget > 0:
            request = self.running[req_idx]
            num_computed = request.num_computed_tokens
            num_new = min(request.num_tokens - num_computed, step.token_budget)
            num_new, items, _, _ = self._plan_encoder_inputs(request, num_computed, num_new, step)
            if num_new == 0:
                self._reserve_encoder_inputs(request, items, step)  # it stands at one to send
                req_idx += 1
                continue
            new_block_ids = self._allocate_or_preempt(request, num_new, step)
            if new_block_ids is None:
                break  # it preempted itself: nothing older is left to take from
            step.add_cached(request.request_id, new_block_ids, num_computed)
            self._commit(request, num_new, items, step)
            req_idx += 1

    def _allocate_or_preempt(
        self, request: Request, num_new: int, step: StepPlan
    ) -> list[int] | None:
        """Allocate KV for a running request, preempting the newest running requests (maybe
        this one) until it fits. None if the request itself was preempted."""
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            victim = self.running.pop()
            self._preempt(victim)
            step.preempted.add(victim.request_id)
            if victim is request:
                return None

    def _schedule_waiting(self, step: StepPlan) -> None:
        skipped: list[Request] = []
        max_num_seqs = self.scheduler_config.max_num_seqs
        while self.waiting and step.token_budget > 0 and len(self.running) < max_num_seqs:
            request = self.waiting.popleft()
            computed = self.kv_cache_manager.get_computed_blocks(request)
            num_computed = computed.num_computed_tokens
            if self.kv_cache_manager.is_next_block_in(
                request, num_computed, step.inflight_block_hashes
            ):
                # NOTE: its next prefix block is being computed by another request in this
                # very step; waiting one step turns that recomputation into a cache hit.
                skipped.append(request)
                continue
            num_new = min(request.num_tokens - num_computed, step.token_budget)
            try:
                plan = self._plan_encoder_inputs(request, num_computed, num_new, step)
            except PixelsGone as gone:
                self._fail_at_schedule(request, gone)  # releases what it holds
                continue
            num_new, items = plan.num_new_tokens, plan.item_idxs
            if num_new == 0:
                skipped.append(request)
                if plan.is_waiting_on_arrival:
                    # NOTE: blocked only by the encoder source: it keeps its references (a
                    # dropped one would cancel the item) and sends what it stands at.
                    self._reserve_encoder_inputs(request, items, step)
                    continue
                # Waiting requests hold no other encoder references: drop the lookup's hits.
                self.encoder_cache_manager.free(request)
                if plan.is_rolled_back:
                    break  # it waits for a whole-item budget: later arrivals must not starve it
                continue
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new, computed)
            if block_ids is None:
                self.encoder_cache_manager.free(request)
                skipped.append(request)
                break  # KV is short: later arrivals must not overtake
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_computed
            if request.first_scheduled_time_s is None:
                request.first_scheduled_time_s = step.now_s
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.add_new(request, block_ids, num_computed)
            self._commit(request, num_new, items, step)
        self.waiting.extendleft(reversed(skipped))

    def _reserve_encoder_inputs(self, request: Request, items: list[int], step: StepPlan) -> None:
        step.encoder_patch_budget -= reserve_encoder_inputs(
            request, items, self.encoder_cache_manager, step.encoder_inputs, step.remote_inputs
        )

    def _plan_encoder_inputs(
        self, request: Request, num_computed: int, num_new: int, step: StepPlan
    ) -> EncoderPlan:
        return plan_encoder_inputs(
            request,
            num_computed,
            num_new,
            manager=self.encoder_cache_manager,
            item_data=self.item_data,
            patch_budget=step.encoder_patch_budget,
            disable_chunked_mm_input=self.scheduler_config.disable_chunked_mm_input,
        )

    def _fail_at_schedule(self, request: Request, gone: PixelsGone) -> None:
        logger.warning(
            "request %s: the pixels of item %s, needed again after a preemption, were evicted "
            "from the re-encode store (over its byte budget); failing the request",
            request.request_id,
            gone.identifier[:16],
        )
        self._failed_at_schedule.append(self._fail(request, gone.failure()))

    def _fail(self, request: Request, failure: RequestFailure) -> RequestUpdate:
        """End a request (not in `running` or `waiting` any more) with an error; its update."""
        request.status = RequestStatus.FINISHED_ERROR
        self._release(request)
        return RequestUpdate(
            request.request_id,
            [],
            request.status,
            error=failure,
            num_cached_tokens=request.num_cached_tokens or 0,
            first_scheduled_time_s=self._take_schedule_time(request),
        )

    def _commit(self, request: Request, num_new: int, items: list[int], step: StepPlan) -> None:
        """Book a scheduled request: encoder cache bytes, budgets, and its advanced position."""
        step.inflight_block_hashes.update(
            self.kv_cache_manager.block_hashes_to_compute(request, num_new)
        )
        self._reserve_encoder_inputs(request, items, step)
        step.book_tokens(request.request_id, num_new)
        request.num_computed_tokens += num_new

    def _preempt(self, request: Request) -> None:
        """Recompute later: free blocks and encoder references, keep generated tokens."""
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------------------ update

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Apply a finished step: commit computed KV blocks, drop consumed encoder inputs,
        append sampled tokens and apply stop rules. Sampled tokens of a request whose step did
        not reach the end of its tokens (partial prefill) are ignored."""
        updates, self._failed_at_schedule = self._failed_at_schedule, []
        updates += self._apply_encoder_results(runner_output)
        finished: list[Request] = []
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None:
                continue  # finished (aborted) after this step was scheduled
            error = runner_output.errors.get(request_id)
            if error is not None:
                self.running.remove(request)  # every scheduled request is running
                updates.append(self._fail(request, error))
                continue
            self.kv_cache_manager.cache_blocks(request)
            free_consumed_encoder_inputs(request, self.encoder_cache_manager)
            if self.item_data is not None:
                self._mark_passed_items(request)
            new_token_ids = self._append_sampled(request, runner_output)
            if request.is_finished:
                finished.append(request)
            if new_token_ids or request.is_finished:
                logprobs = runner_output.logprobs.get(request_id) if new_token_ids else None
                prompt_logprobs = runner_output.prompt_logprobs.get(request_id)
                updates.append(
                    RequestUpdate(
                        request_id,
                        new_token_ids,
                        request.status if request.is_finished else None,
                        stop_reason=request.stop_reason,
                        num_cached_tokens=request.num_cached_tokens or 0,
                        first_scheduled_time_s=self._take_schedule_time(request),
                        logprobs=None if logprobs is None else logprobs.head(len(new_token_ids)),
                        prompt_logprobs=prompt_logprobs,
                    )
                )
        if finished:
            done = {r.request_id for r in finished}
            self.running = [r for r in self.running if r.request_id not in done]
            for request in finished:
                self._release(request)
        return updates

    def _apply_encoder_results(self, runner_output: ModelRunnerOutput) -> list[RequestUpdate]:
        """Mark remote items arrived; fail every request holding an item that failed (its
        other state is freed as for any failure). Results for items cancelled since they
        were sent are ignored."""
        failing = self.encoder_cache_manager.apply_remote_results(
            runner_output.encoder_arrived, runner_output.encoder_failed
        )
        if not failing:
            return []
        self.running = [r for r in self.running if r.request_id not in failing]
        self.waiting = deque(r for r in self.waiting if r.request_id not in failing)
        return [self._fail(self.requests[rid], failure) for rid, failure in failing.items()]

    @staticmethod
    def _mark_passed_items(request: Request) -> None:
        """Items the prefill has passed are encoded again only after a preemption, from what
        the executor side keeps (bounded) of their data."""
        for feature in request.mm_features:
            if feature.placeholder.end > request.num_computed_tokens:
                break  # items are sorted by offset
            request.passed_items.add(feature.identifier)

    def _take_schedule_time(self, request: Request) -> float | None:
        """The first-scheduled time on the request's first update, None on every later one."""
        if request.is_schedule_time_reported:
            return None
        request.is_schedule_time_reported = True
        return request.first_scheduled_time_s

    def _append_sampled(self, request: Request, runner_output: ModelRunnerOutput) -> list[int]:
        if request.num_computed_tokens < request.num_tokens:
            return []
        new_token_ids = []
        for token_id in runner_output.sampled_token_ids.get(request.request_id, ()):
            request.output_token_ids.append(token_id)
            new_token_ids.append(token_id)
            if check_stop(request, self.scheduler_config.max_model_len, self.eos_token_ids):
                break
        return new_token_ids

    def _release(self, request: Request) -> None:
        """Free everything a finished request holds; the runner hears of it next step."""
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.add(request.request_id)
