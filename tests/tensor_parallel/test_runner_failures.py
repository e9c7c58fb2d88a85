"""Per-request decisions on two ranks are the same decisions: an item that fails to encode on
one rank fails its requests on every rank, a sampling failure reaches every rank, and the
pieces of the split (largest first, ties by identifier) are the same on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmserve import SamplingParams
from mmserve.errors import FailureKind, RequestFailure
from mmserve.execution.encoder.runner import EncodeJob
from mmserve.execution.encoder.step import StepEncoder, split_by_patches
from mmserve.execution.model_runner import ModelRunner
from mmserve.execution.sample.broadcast import broadcast_tokens
from mmserve.layers.parallel import TPGroup
from mmserve.multimodal import MultiModalFeature, PlaceholderRange
from tests.support.distributed import run_ranks
from tests.support.factory import random_image, write_tiny_checkpoint
from tests.support.parity_cases import DIVERSE, IMG, chat
from tests.support.tp_replay import assert_same_answers, record, replay_on_rank, summary

# a small KV cache: zeroing the CPU default (2 GiB) costs each engine seconds
ENGINE_ARGS = {"max_num_batched_tokens": 64, "block_size": 4, "kv_cache_memory_bytes": 16 << 20}
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
BAD_GRID = (1, 4, 8)  # Qwen2-VL's grid of the 112x60 picture: 112x56 pixels, patches of 14


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tp_fail"), "qwen2_vl", seed=3, **DIVERSE)


def requests() -> list:
    good, bad = random_image(56, 84, seed=1), random_image(112, 60, seed=2)
    return [
        ({"prompt": chat(f"{IMG}What is it?"), "multi_modal_data": {"image": [good]}}, GREEDY),
        ({"prompt": chat(f"{IMG} and{IMG}?"), "multi_modal_data": {"image": [bad, good]}}, GREEDY),
        ({"prompt": chat(f"{IMG}Again?"), "multi_modal_data": {"image": [bad]}}, GREEDY),
        (chat("Describe a red circle."), GREEDY),
    ]


@pytest.mark.parametrize(
    ("mode", "fail_ranks", "after"),
    [
        pytest.param("data", None, False, id="data_fails_on_its_owner"),
        # slow: weights mode's agreement is the one-rank case below; this one only adds the
        # input that fails on every rank alike
        pytest.param(
            "weights", None, False, id="weights_fails_on_every_rank", marks=pytest.mark.slow
        ),
        pytest.param("weights", [1], True, id="weights_fails_on_rank_1"),
    ],
)
def test_a_bad_item_fails_the_same_requests_on_every_rank(
    checkpoint: Path, mode: str, fail_ranks: list[int] | None, after: bool
) -> None:
    """Data mode: the item fails on the rank whose share it is, and the other learns it from
    the row counts. Weights mode: a bad input fails on every rank; a failure on one rank only
    (after the sharded tower ran, so the collectives matched) is agreed on."""
    recorder, results, _ = record(checkpoint, ENGINE_ARGS, requests(), fail_grids=[BAD_GRID])
    single = [summary(o) for o in recorder.outputs]
    errors = {rid: kind for step in single for rid, kind in step["errors"].items()}
    assert sorted(errors.values()) == ["internal", "internal"]  # the two holding the bad item
    assert sum(1 for r in results if r.outputs[0].token_ids) == 2  # the others answer

    (rank0, _, _), (rank1, _, _) = run_ranks(
        replay_on_rank,
        2,
        checkpoint,
        ENGINE_ARGS,
        recorder.calls,
        mode,
        [BAD_GRID],
        fail_ranks,
        after,
    )
    assert len(rank0) == len(single)
    for expected, first, second in zip(single, rank0, rank1, strict=True):
        assert_same_answers(expected, first["output"])
        assert second["output"]["errors"] == first["output"]["errors"]
        assert second["states"] == first["states"]
        assert second["cache"] == first["cache"]


def _tokens_from_rank_0(group: TPGroup) -> list:
    sent = [
        5,
        RequestFailure("nan", FailureKind.INTERNAL),
        7,
        RequestFailure("x", FailureKind.REQUEST),
    ]
    got = broadcast_tokens(group, sent if group.is_first else None, 4, torch.device("cpu"))
    return [t if isinstance(t, int) else t.kind for t in got]


def test_rank_0_tokens_and_failures_reach_every_rank() -> None:
    expected = [5, FailureKind.INTERNAL, 7, FailureKind.REQUEST]
    assert run_ranks(_tokens_from_rank_0, 2) == [expected, expected]


def _job(identifier: str, side: int) -> EncodeJob:
    grid = (1, side, side)
    feature = MultiModalFeature(
        identifier * 64, "image", PlaceholderRange(0, side * side // 4), grid
    )
    return EncodeJob(feature, None)


def test_items_split_largest_first_with_ties_by_identifier() -> None:
    jobs = [_job("a", 4), _job("d", 8), _job("c", 4), _job("b", 4), _job("e", 2)]
    shares = split_by_patches(jobs, 2)
    # patches: d 64, then a/b/c 16 each by identifier, then e 4
    assert [[j.feature.identifier[0] for j in s] for s in shares] == [["d"], ["a", "b", "c", "e"]]
    assert split_by_patches(list(reversed(jobs)), 2) == shares  # the order given does not matter
    names = [[j.feature.identifier[0] for j in s] for s in split_by_patches(jobs, 3)]
    assert names == [["d"], ["a", "c"], ["b", "e"]]  # equal loads go to the lower rank


def test_unsupported_combinations_are_refused() -> None:
    two = TPGroup(rank=0, size=2, group=object())
    with pytest.raises(ValueError, match="--encoder-urls"):
        ModelRunner(
            None,
            [],
            None,
            block_size=4,
            placeholder_token_ids=(1,),
            device=torch.device("cpu"),
            encoder_source=object(),
            tp=two,
        )
    with pytest.raises(ValueError, match="mm_encoder_tp_mode"):
        StepEncoder(tp=two, mode="pipeline", embedding_width=8)
