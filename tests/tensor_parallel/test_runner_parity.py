"""ModelRunners on two gloo ranks, each over its shard of the model, answer as one device
does: rank 0's tokens and top-k logprobs equal the single-device runner's, the other rank's
request states follow rank 0's tokens step by step, and every rank's encoder cache holds every
item with the same bytes.

Images, chunked prefill cutting through them, prefix caching, encoder-cache hits (a picture
repeated), a seeded sampled request; every architecture, both `--mm-encoder-tp-mode`s.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mmserve import SamplingParams
from mmserve.models.loader import load_model
from tests.support.distributed import run_ranks
from tests.support.factory import random_image, write_tiny_checkpoint
from tests.support.parity_cases import DIVERSE, IMG, chat
from tests.support.tp_replay import assert_same_answers, record, replay_on_rank, summary

# a small KV cache: zeroing the CPU default (2 GiB) costs each engine seconds
ENGINE_ARGS = {"max_num_batched_tokens": 64, "block_size": 4, "kv_cache_memory_bytes": 16 << 20}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)


# (architecture, tower mode): the default run covers each mode and the DeepStack tower once
# (the end-to-end TP=2 parity of every architecture is test_llm_parity.py); the rest are slow.
CASES = [
    ("qwen3_vl", "data"),
    ("qwen2_5_vl", "weights"),
    pytest.param("qwen2_vl", "data", marks=pytest.mark.slow),
    pytest.param("qwen2_vl", "weights", marks=pytest.mark.slow),
    pytest.param("qwen2_5_vl", "data", marks=pytest.mark.slow),
    pytest.param("qwen3_vl", "weights", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {}


def _checkpoint(checkpoints: dict[str, Path], arch: str, tmp_path_factory) -> Path:
    if arch not in checkpoints:
        out = tmp_path_factory.mktemp(f"tp_{arch}")
        checkpoints[arch] = write_tiny_checkpoint(out, arch, seed=3, **DIVERSE)
    return checkpoints[arch]


def requests() -> list:
    a, b, c = random_image(56, 84, seed=1), random_image(112, 60, seed=2), random_image(84, 84, 3)
    return [
        ({"prompt": chat(f"{IMG}What is it?"), "multi_modal_data": {"image": [a]}}, GREEDY),
        (chat("Describe a red circle."), GREEDY),
        (
            {"prompt": chat(f"{IMG} then{IMG} Same?"), "multi_modal_data": {"image": [b, c]}},
            GREEDY,
        ),
        ({"prompt": chat(f"{IMG}And this?"), "multi_modal_data": {"image": [c]}}, SEEDED),
        ({"prompt": chat(f"{IMG}What is it?"), "multi_modal_data": {"image": [a]}}, GREEDY),
    ]


def max_items_per_step(calls: list[tuple]) -> int:
    """The most distinct items one step scheduled to encode."""
    most = 0
    for call in calls:
        if call[0] == "execute":
            so = call[1]
            ids = set()
            for new in so.scheduled_new_reqs:
                for i in so.scheduled_encoder_inputs.get(new.request_id, ()):
                    ids.add(new.mm_features[i].identifier)
            most = max(most, len(ids))
    return most


@pytest.mark.parametrize(("arch", "mode"), CASES)
def test_two_ranks_answer_as_one_device(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, arch: str, mode: str
) -> None:
    checkpoint = _checkpoint(checkpoints, arch, tmp_path_factory)
    recorder, results, num_encoded = record(checkpoint, ENGINE_ARGS, requests())
    assert all(len(r.outputs[0].token_ids) == 6 for r in results)
    assert max_items_per_step(recorder.calls) >= 2  # some step splits items across the ranks
    single = [summary(o) for o in recorder.outputs]

    (rank0, encoded0, params0), (rank1, encoded1, params1) = run_ranks(
        replay_on_rank, 2, checkpoint, ENGINE_ARGS, recorder.calls, mode
    )

    assert len(rank0) == len(rank1) == len(single)
    for step, (expected, first, second) in enumerate(zip(single, rank0, rank1, strict=True)):
        assert_same_answers(expected, first["output"])
        assert second["output"]["sampled"] == first["output"]["sampled"], step
        assert second["states"] == first["states"], step
        assert second["cache"] == first["cache"], step
    assert any(step["cache"] for step in rank0)
    whole = sum(p.numel() for p in load_model(checkpoint)[0].parameters())
    assert params0 == params1 < whole  # each rank holds its shard
    if mode == "data":  # each item through one rank's tower, and both ranks had a share
        assert encoded0 + encoded1 == num_encoded and encoded0 > 0 and encoded1 > 0
    else:  # the (sharded) tower runs every item on every rank
        assert encoded0 == encoded1 == num_encoded
