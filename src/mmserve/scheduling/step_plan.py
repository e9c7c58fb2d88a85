"""The step one `Scheduler.schedule()` call is building: budgets left and what is scheduled."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.multimodal import MultiModalFeature
from mmserve.scheduling.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from mmserve.scheduling.request import Request


@dataclass(slots=True)
class StepPlan:
    """Scratch state of one `schedule()` call; `to_output` freezes it into the step's plan."""

    token_budget: int
    encoder_patch_budget: int  # input patches the encoder may still process this step
    now_s: float  # the scheduler's clock when the step was planned
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    remote_inputs: dict[str, list[MultiModalFeature]] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    # hashes of the full KV blocks this step will compute (to defer requests that share them)
    inflight_block_hashes: set[str] = field(default_factory=set)

    def add_new(self, request: Request, block_ids: list[int], num_computed: int) -> None:
        """A waiting request scheduled for the first time (or again after a preemption)."""
        self.new_reqs.append(
            NewRequestData(
                request_id=request.request_id,
                token_ids=request.all_token_ids,
                mm_features=list(request.mm_features),
                block_ids=block_ids,
                num_computed_tokens=num_computed,
                payload=request.payload,
            )
        )

    def add_cached(self, request_id: str, new_block_ids: list[int], num_computed: int) -> None:
        """A running request scheduled again: only its new blocks travel."""
        self.cached_reqs.append(CachedRequestData(request_id, new_block_ids, num_computed))

    def book_tokens(self, request_id: str, num_new: int) -> None:
        self.num_scheduled_tokens[request_id] = num_new
        self.token_budget -= num_new

    def to_output(
        self, free_encoder_identifiers: list[str], finished_req_ids: set[str]
    ) -> SchedulerOutput:
        return SchedulerOutput(
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=self.cached_reqs,
            num_scheduled_tokens=self.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(self.num_scheduled_tokens.values()),
            scheduled_encoder_inputs=self.encoder_inputs,
            free_encoder_identifiers=free_encoder_identifiers,
            finished_req_ids=frozenset(finished_req_ids),
            preempted_req_ids=frozenset(self.preempted),
            remote_encoder_inputs=self.remote_inputs,
        )
