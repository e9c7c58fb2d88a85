"""The runner's input preparation (`prepare_batch` on `InputBuffers`), on the CPU: the flat batch's
token ids, M-RoPE positions, KV slots, sampling rows and embedding splice indices for chunked
prefills, decodes and mixes of both, and the requests that fail alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.errors import FailureKind, RequestFailure
from mmserve.execution.input_batch import InputBuffers, SpliceError, prepare_batch
from mmserve.execution.request_state import RequestState, RunnerPayload
from mmserve.layers.attention import TorchAttentionBackend
from mmserve.layers.attention.buffers import BatchLimits
from mmserve.sampling_params import SamplingParams
from mmserve.scheduling.outputs import SchedulerOutput

BLOCK_SIZE = 4
CPU = torch.device("cpu")


def _state(
    request_id: str,
    token_ids: list[int],
    *,
    num_prompt: int,
    block_ids: list[int],
    num_computed: int,
    positions: np.ndarray | None = None,
    delta: int = 0,
) -> RequestState:
    if positions is None:  # a text prompt: every row counts 0, 1, 2, ...
        positions = np.tile(np.arange(num_prompt, dtype=np.int64), (3, 1))
    payload = RunnerPayload(SamplingParams(temperature=0), positions, delta, (0,))
    return RequestState(request_id, token_ids, [], block_ids, num_computed, payload)


def _step(num_scheduled: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput(
        [], [], num_scheduled, sum(num_scheduled.values()), {}, [], frozenset(), frozenset()
    )


def _no_images(state, start, end, window_ids):
    return [], []


def _buffers(tokens: int = 64, seqs: int = 8, blocks: int = 8) -> InputBuffers:
    return InputBuffers(BatchLimits(tokens, seqs, blocks), CPU)


def _prepare(states, num_scheduled, gather=_no_images, buffers=None, errors=None):
    errors = {} if errors is None else errors
    batch = prepare_batch(
        _step(num_scheduled),
        states,
        errors,
        gather,
        buffers or _buffers(),
        TorchAttentionBackend(),
        BLOCK_SIZE,
    )
    return batch, errors


def _mixed_states() -> dict[str, RequestState]:
    # "img": an image prompt of 7 tokens whose M-RoPE rows differ (t, h, w), delta -3
    img_positions = np.array(
        [[0, 1, 1, 1, 1, 3, 4], [0, 1, 1, 2, 2, 3, 4], [0, 1, 2, 1, 2, 3, 4]], dtype=np.int64
    )
    return {
        # a prefill chunk: tokens [0, 5) of a 7-token prompt, nothing sampled yet
        "img": _state(
            "img",
            [10, 11, 11, 11, 11, 12, 13],
            num_prompt=7,
            block_ids=[3, 7],
            num_computed=0,
            positions=img_positions,
            delta=-2,
        ),
        # a decode: 6 prompt tokens, 2 generated, the last one not yet in the KV cache
        "dec": _state(
            "dec",
            [20, 21, 22, 23, 24, 25, 26, 27],
            num_prompt=6,
            block_ids=[2, 5],
            num_computed=7,
            delta=-3,
        ),
        # the last chunk of a 6-token prompt: tokens [4, 6), then it samples
        "tail": _state(
            "tail", [30, 31, 32, 33, 34, 35], num_prompt=6, block_ids=[1, 9], num_computed=4
        ),
    }


def test_a_mixed_step_lays_out_chunks_and_decodes_flat_in_scheduling_order() -> None:
    batch, errors = _prepare(_mixed_states(), {"img": 5, "dec": 1, "tail": 2})
    assert not errors and batch is not None
    assert batch.request_ids == ["img", "dec", "tail"]
    assert batch.input_ids.tolist() == [10, 11, 11, 11, 11, 27, 34, 35]
    # the chunk's M-RoPE rows from the processor; the decode's text position is its index
    # plus the prompt's delta (7 - 3 = 4) on every row; the tail's prompt positions
    assert batch.positions.tolist() == [
        [0, 1, 1, 1, 1, 4, 4, 5],
        [0, 1, 1, 2, 2, 4, 4, 5],
        [0, 1, 2, 1, 2, 4, 4, 5],
    ]
    meta = batch.attn_metadata
    # slot = block_ids[p // 4] * 4 + p % 4: img's positions 0-4 in blocks 3 and 7, dec's
    # position 7 in block 5, tail's positions 4 and 5 in block 9
    assert meta.slot_mapping.tolist() == [12, 13, 14, 15, 28, 23, 36, 37]
    assert meta.query_start_loc.tolist() == [0, 5, 6, 8]
    assert meta.seq_lens.tolist() == [5, 8, 6]
    assert meta.block_tables.tolist() == [[3, 7], [2, 5], [1, 9]]
    # only the steps that reach the end of their tokens sample, at their last flat row
    assert batch.sample_request_ids == ["dec", "tail"]
    assert batch.sample_rows.tolist() == [5, 7]
    assert batch.mm_index is None and batch.mm_embeds is None
    assert not batch.is_pure_decode


def test_a_decode_only_step_is_pure_decode_and_positions_continue_past_the_prompt() -> None:
    states = _mixed_states()
    states["tail"].token_ids.append(36)  # its prompt is in the cache and it sampled once
    states["tail"].num_computed_tokens = 6
    batch, _ = _prepare({k: states[k] for k in ("dec", "tail")}, {"dec": 1, "tail": 1})
    assert batch.input_ids.tolist() == [27, 36]
    assert batch.positions.tolist() == [[4, 6]] * 3
    assert batch.attn_metadata.slot_mapping.tolist() == [23, 38]
    assert batch.sample_rows.tolist() == [0, 1]
    assert batch.is_pure_decode


def test_a_chunk_that_ends_mid_prompt_samples_nothing() -> None:
    batch, _ = _prepare({"img": _mixed_states()["img"]}, {"img": 3})
    assert batch.input_ids.tolist() == [10, 11, 11]
    assert batch.sample_request_ids == [] and batch.sample_rows.tolist() == []


def test_image_rows_are_spliced_at_their_flat_indices_in_the_step() -> None:
    """The gather gives indices within a request's window; the batch shifts them by where the
    request's tokens start in the flat batch, and keeps the embeddings in that order."""
    states = _mixed_states()
    rows = {"img": torch.full((4, 2), 1.0), "tail": torch.full((1, 2), 2.0)}

    def gather(state, start, end, window_ids):
        if state.request_id == "img":  # placeholders at tokens 1-4 of the window [0, 5)
            return [1, 2, 3, 4], [rows["img"]]
        if state.request_id == "tail":  # pretend token 5 (window index 1) is one
            return [1], [rows["tail"]]
        return [], []

    batch, _ = _prepare(states, {"img": 5, "dec": 1, "tail": 2}, gather)
    assert batch.mm_index.tolist() == [1, 2, 3, 4, 7]
    assert batch.mm_embeds.tolist() == [[1.0, 1.0]] * 4 + [[2.0, 2.0]]
    assert not batch.is_pure_decode


def test_a_request_whose_splice_fails_is_left_out_and_the_rest_runs() -> None:
    def gather(state, start, end, window_ids):
        if state.request_id == "img":
            raise SpliceError("Attempted to assign 3 multimodal tokens to 4 placeholders")
        return [], []

    batch, errors = _prepare(_mixed_states(), {"img": 5, "dec": 1, "tail": 2}, gather)
    assert errors["img"].kind is FailureKind.REQUEST and "3 multimodal" in errors["img"].message
    assert batch.request_ids == ["dec", "tail"]
    assert batch.input_ids.tolist() == [27, 34, 35]
    assert batch.sample_rows.tolist() == [0, 2]
    assert batch.attn_metadata.slot_mapping.tolist() == [23, 36, 37]


def test_requests_already_failed_this_step_are_skipped_and_none_left_is_none() -> None:
    failed = RequestFailure("encoding failed", FailureKind.INTERNAL)
    states = _mixed_states()
    batch, errors = _prepare(states, {"img": 5, "dec": 1}, errors={"img": failed})
    assert batch.request_ids == ["dec"] and errors["img"] is failed
    batch, _ = _prepare(states, {"img": 5}, errors={"img": failed})
    assert batch is None


def test_a_step_within_the_limits_writes_the_persistent_buffers() -> None:
    buffers = _buffers()
    batch, _ = _prepare(_mixed_states(), {"img": 5, "dec": 1, "tail": 2}, buffers=buffers)
    # views of the buffers allocated at start-up: no tensor allocated for the step's inputs
    assert batch.input_ids.data_ptr() == buffers.input_ids.host.data_ptr()
    assert batch.positions.data_ptr() == buffers.positions.host.data_ptr()
    assert batch.sample_rows.data_ptr() == buffers.sample_rows.host.data_ptr()
    assert batch.attn_metadata.slot_mapping.data_ptr() == (
        buffers.attention.slot_mapping.host.data_ptr()
    )


@pytest.mark.parametrize("limits", [(4, 8, 8), (64, 2, 8), (64, 8, 1)])
def test_a_step_past_the_limits_gets_exact_buffers_and_the_same_values(limits) -> None:
    num_scheduled = {"img": 5, "dec": 1, "tail": 2}
    want, _ = _prepare(_mixed_states(), num_scheduled)
    small = _buffers(*limits)
    got, _ = _prepare(_mixed_states(), num_scheduled, buffers=small)
    assert got.input_ids.data_ptr() != small.input_ids.host.data_ptr()
    assert got.input_ids.tolist() == want.input_ids.tolist()
    assert got.positions.tolist() == want.positions.tolist()
    assert got.sample_rows.tolist() == want.sample_rows.tolist()
    assert got.attn_metadata.slot_mapping.tolist() == want.attn_metadata.slot_mapping.tolist()
    assert got.attn_metadata.block_tables.tolist() == want.attn_metadata.block_tables.tolist()
