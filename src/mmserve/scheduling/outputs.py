"""Messages across the scheduler boundary: the step sent to the runner and its answer (what one
step did to one request, `RequestUpdate`, is a leaf value: `mmserve.updates`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mmserve.errors import RequestFailure
from mmserve.metrics import SchedulerStats
from mmserve.multimodal import MultiModalFeature
from mmserve.sampling_params import SamplingParams
from mmserve.updates import Logprobs

__all__ = [
    "CachedRequestData",
    "GrammarOutput",
    "ModelRunnerOutput",
    "NewRequestData",
    "RunnerPayload",
    "SchedulerOutput",
    "SchedulerStats",  # defined beside the metric names it carries (mmserve.metrics)
]


@dataclass(frozen=True)
class RunnerPayload:
    """Attached to a scheduler Request by the engine and handed to the runner unread.

    Plain data: a seeded request's draws are keyed by its seed and output position
    (`sample.noise.seeded_keys`), so no random state lives here or anywhere.
    """

    sampling_params: SamplingParams
    mrope_positions: np.ndarray  # [3, num_prompt_tokens] int64
    mrope_position_delta: int
    eos_token_ids: tuple[int, ...]

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.mrope_positions.shape[1])


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has no state for: first scheduled, or resumed after preemption.

    `token_ids` is prompt + every token generated so far (a resumed request re-prefills its
    outputs); `num_computed_tokens` is where this step starts (the prefix-cache hit length).
    """

    request_id: str
    token_ids: list[int]
    mm_features: list[MultiModalFeature]
    block_ids: list[int]
    num_computed_tokens: int
    payload: RunnerPayload | None  # None only in tests that run no model


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds: blocks appended this step and where the step starts."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(frozen=True)
class GrammarOutput:
    """The allowed next tokens of the step's structured requests: the engine core computes it
    after scheduling and hands it to the executor's sampling beside the `SchedulerOutput`.

    Row i of `bitmask` belongs to `request_ids[i]`: bit j of word w allows token 32 * w + j.
    Requests not listed sample from their whole vocabulary.
    """

    request_ids: tuple[str, ...]
    bitmask: np.ndarray  # [len(request_ids), ceil(vocab / 32)] int32

    def __post_init__(self) -> None:
        shape = self.bitmask.shape
        if self.bitmask.dtype.str != "<i4" or len(shape) != 2 or shape[0] != len(self.request_ids):
            raise ValueError(
                f"grammar bitmask is {self.bitmask.dtype} {shape}, expected int32 "
                f"[{len(self.request_ids)}, num_words]"
            )
        if len(set(self.request_ids)) != len(self.request_ids):
            raise ValueError("grammar bitmask: a request id appears twice")


@dataclass(frozen=True)
class SchedulerOutput:
    """One engine step, as diffs against what the runner already has.

    The runner applies it in this order: drop `finished_req_ids` and `preempted_req_ids`, free
    `free_encoder_identifiers` from its encoder cache (cancelling those still in flight at its
    encoder source), take what the source has delivered, send every item of
    `remote_encoder_inputs` to the source, encode every item in `scheduled_encoder_inputs`
    (each identifier appears at most once per step, in one of the two), then run the language
    model on `num_scheduled_tokens[req]` tokens of each request starting at its
    `num_computed_tokens`. A request gets sampled tokens only when its step reaches the end
    of its known tokens.

    `remote_encoder_inputs` carries item specs, not item indexes: a request may send an item
    while it schedules no token (it stands at the item), so the runner may hold no state for
    it (the executor side holds its `RemoteItem` by identifier since the request was added).
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_encoder_inputs: dict[str, list[int]]
    free_encoder_identifiers: list[str]
    finished_req_ids: frozenset[str]
    preempted_req_ids: frozenset[str]
    # request id -> items sent to the encoder source this step (see above)
    remote_encoder_inputs: dict[str, list[MultiModalFeature]] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelRunnerOutput:
    """The runner's answer: sampled tokens per request, their logprobs for requests that asked,
    and requests that failed inside it (e.g. a placeholder/embedding count mismatch) with why
    and whose fault it is.

    `encoder_arrived` names the remote items whose embeddings are now in the runner's encoder
    cache; `encoder_failed` the remote items nobody could encode, with the failure every
    request holding one ends with.
    """

    sampled_token_ids: dict[str, list[int]]
    errors: dict[str, RequestFailure] = field(default_factory=dict)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    encoder_arrived: list[str] = field(default_factory=list)
    encoder_failed: dict[str, RequestFailure] = field(default_factory=dict)
    # the whole prompt's logprobs of requests that asked, with their first sampled token
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)
