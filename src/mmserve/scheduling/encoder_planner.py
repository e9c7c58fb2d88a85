"""Encoder-input planning for one request's window: which items to encode, where to cut.

Window/item arithmetic. Each step a request computes the window
`[num_computed_tokens, num_computed_tokens + num_new_tokens)` of its tokens. An item (its
placeholder range `[offset, offset + length)`) that overlaps the window must have its encoder
output resident before the step runs:

    tokens     0 ........ offset ............. offset+length ........ num_tokens
    item                    |#######  image  #######|
    window A    [---------------)                             chunk cuts the image: the
                                                              item is encoded whole now,
                                                              later chunks slice it
    window B             [--------------------------------)   covers it all
    window C                         [-------)                 later chunk: already resident
    no space       [-----)|                                    cut to stop at `offset`
    no space, at offset   |  (0 tokens)                        skip this request this step
    in flight      [-----)|                                    remote item not arrived: cut
                                                              at `offset`, reference kept

- Resident (a hit) -> nothing to encode. Otherwise the item needs patch budget (its input
  patches, out of the step's encoder budget) and cache bytes;
  if it cannot have them now, the window is cut to end at `offset` (text before the image
  still runs), or to zero tokens when the request already stands at (or, after a prefix-cache
  hit, inside) the item. Other requests go on.
- Remote items (`is_remote`, a disaggregated server) go to the encoder source, not
  the local vision tower: they take cache bytes but no patch budget, and stay in flight until
  the runner reports them arrived. An item in flight (or sent this step) blocks the window at
  its offset exactly like "no space"; every remote item the window reaches is sent in the
  same step. A request blocked only by items in flight keeps its references, even a waiting
  one that schedules 0 tokens (it sends its item with no token scheduled), so an item is
  never cancelled and sent again in a loop. An item that fails fails every request holding
  it (`ModelRunnerOutput.encoder_failed`); one whose last holder goes is cancelled.
- `disable_chunked_mm_input`: a window that starts at or before `offset` and would end inside
  the item is rolled back to end at `offset`.
- A prefix-cache hit that covers an item whole means it is never encoded; a hit ending inside
  an item still needs the whole item encoded, and only the tail slice is spliced.
- An item's reference is dropped once `num_computed_tokens >= offset + length` (consumed);
  the entry stays resident (freeable) for later requests with the same identity. So a
  request only ever holds the items its position cuts through (and remote items in flight in
  its window, which need nothing but their arrival): those need nothing but token budget to
  finish, which is why a waiting item always gets its cache space eventually.
"""

from __future__ import annotations

from typing import NamedTuple

from mmserve.multimodal import MultiModalFeature
from mmserve.scheduling.encoder_cache_manager import EncoderCacheManager
from mmserve.scheduling.item_data import ItemDataHolder, PixelsGone
from mmserve.scheduling.request import Request


class EncoderPlan(NamedTuple):
    """What the encoder can serve of one window.

    `num_new_tokens` is the window cut to what can run now; `item_idxs` the items to encode or
    send this step. `is_rolled_back`: the `disable_chunked_mm_input` rollback cut it.
    `is_waiting_on_arrival`: it was cut at an item that is in flight, or sent this step, so
    the request waits for nothing but the encoder source (its references must be kept).
    """

    num_new_tokens: int
    item_idxs: list[int]
    is_rolled_back: bool = False
    is_waiting_on_arrival: bool = False


def plan_encoder_inputs(
    request: Request,
    num_computed: int,
    num_new: int,
    *,
    manager: EncoderCacheManager,
    item_data: ItemDataHolder | None,
    patch_budget: int,
    disable_chunked_mm_input: bool,
) -> EncoderPlan:
    """Shrink `num_new` to what the encoder can serve now (the scheduler's window rule).

    `patch_budget` is the input patches the step's local encoder may still process (remote
    items need none). An item another request sent this step is in flight already. Raises
    `PixelsGone` when a preempted request needs pixels the executor side evicted.

    A remote item that gets its space is sent now and cuts the window at its offset (text
    before it runs); the loop goes on over the rest of the window, so every remote item the
    window reaches is sent in the same step (they travel to the encoders in parallel).
    """
    window_end = num_computed + num_new
    to_encode: list[int] = []
    identifiers: set[str] = set()
    num_bytes_to_schedule = 0
    num_patches_to_schedule = 0
    cut: int | None = None  # where the window ends for an item not arrived
    for item_idx, feature in enumerate(request.mm_features):
        start, length = feature.placeholder.offset, feature.placeholder.length
        if start >= window_end:
            break  # items are sorted by offset
        if start + length <= num_computed:
            continue  # consumed already (or covered whole by a prefix-cache hit)
        if feature.identifier in identifiers:
            continue  # same item twice in one request: encoded (or sent) once
        if manager.is_inflight(feature.identifier):
            # NOTE: checked before the chunking rollback: a request that stands at an item in
            # flight keeps its reference whatever the budget, so the item is never cancelled
            # and sent again in a loop.
            manager.check_and_update_cache(request, item_idx)
            cut = start if cut is None else cut
            continue
        remote = feature.is_remote
        if cut is not None and not remote:
            break  # beyond an item not arrived: only more remote items are worth starting now
        if cut is None and (
            disable_chunked_mm_input and num_computed <= start and window_end < start + length
        ):
            return EncoderPlan(start - num_computed, to_encode, is_rolled_back=True)
        if manager.check_and_update_cache(request, item_idx):
            continue
        # a remote item costs the local vision tower nothing: no patch budget
        patches_left = feature.num_patches if remote else patch_budget - num_patches_to_schedule
        if not manager.can_allocate(request, item_idx, patches_left, num_bytes_to_schedule):
            if cut is not None:
                break  # the window already ends before this item
            # Text before the item still runs; at (or inside) the item: nothing this step.
            return EncoderPlan(max(0, start - num_computed), to_encode)
        if feature.identifier in request.passed_items:
            # passed only when there is a store (see Scheduler.update_from_output)
            assert item_data is not None
            if not item_data.holds(feature.identifier):
                raise PixelsGone(feature.identifier)
        to_encode.append(item_idx)
        identifiers.add(feature.identifier)
        num_bytes_to_schedule += manager.item_bytes(request, item_idx)
        if remote:
            cut = start if cut is None else cut
        else:
            num_patches_to_schedule += feature.num_patches
    if cut is None:
        return EncoderPlan(num_new, to_encode)
    return EncoderPlan(max(0, cut - num_computed), to_encode, is_waiting_on_arrival=True)


def free_consumed_encoder_inputs(request: Request, manager: EncoderCacheManager) -> None:
    """Drop references to consumed items (`end <= num_computed_tokens`), unless another
    occurrence of the same identity is cut by the current position.

    NOTE: a later, not yet started occurrence of the same image is not a reason to hold the
    entry: holding cache space for the future can deadlock a small cache. When the window
    reaches it, the lookup hits if it is still resident and re-encodes it otherwise.
    """
    num_computed = request.num_computed_tokens
    in_progress = {
        f.identifier
        for f in request.mm_features
        if f.placeholder.offset < num_computed < f.placeholder.end
    }
    for item_idx, feature in enumerate(request.mm_features):
        if feature.placeholder.end <= num_computed and feature.identifier not in in_progress:
            manager.free_encoder_input(request, item_idx)


def reserve_encoder_inputs(
    request: Request,
    item_idxs: list[int],
    manager: EncoderCacheManager,
    local_inputs: dict[str, list[int]],
    remote_inputs: dict[str, list[MultiModalFeature]],
) -> int:
    """Reserve cache bytes for the planned items: local ones go into the step's
    `local_inputs` (encoded by the runner), remote ones into `remote_inputs` (sent to the
    encoder source, in flight until they arrive). Returns the input patches of the local ones.

    A request that schedules no token may reserve remote items (it stands at the first of
    them); it never reserves a local one without a token to compute.
    """
    num_local_patches = 0
    for item_idx in item_idxs:
        feature = request.mm_features[item_idx]
        if feature.is_remote:
            manager.allocate(request, item_idx, is_remote=True)
            remote_inputs.setdefault(request.request_id, []).append(feature)
        else:
            manager.allocate(request, item_idx)
            local_inputs.setdefault(request.request_id, []).append(item_idx)
            num_local_patches += feature.num_patches
    return num_local_patches
