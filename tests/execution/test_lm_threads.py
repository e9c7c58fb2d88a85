"""On a CPU a small step's language model runs on one intra-op thread, a large one on all of
them (execution/lm_threads.py); the caller's count comes back, and the tokens do not change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from mmserve import LLM, SamplingParams
from mmserve.execution.lm_threads import LMThreads, intra_op_threads, lm_macs_per_token
from tests.support.factory import random_image

CPU = torch.device("cpu")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.visual = nn.Sequential(nn.Linear(8, 8))  # the tower: not the language model's
        self.embed_tokens = nn.Embedding(100, 4)  # read, not multiplied
        self.layer = nn.Linear(4, 6)  # 24 multiply-adds per token; its bias is not a matmul
        self.lm_head = nn.Linear(6, 100, bias=False)  # 600


def test_multiply_adds_per_token_count_the_language_models_matrices_only() -> None:
    assert lm_macs_per_token(_Model()) == 4 * 6 + 6 * 100


@pytest.fixture
def two_threads():
    with intra_op_threads(2):
        yield


def test_a_small_step_runs_on_one_thread_and_gives_the_count_back(two_threads) -> None:
    threads = LMThreads(CPU, macs_per_token=1000, min_parallel_macs=10_000)
    with threads.step(9):  # 9,000 multiply-adds
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), threads.step(1):
        raise RuntimeError("the step failed")
    assert torch.get_num_threads() == 2
    with threads.step(10):  # 10,000: large enough for every thread
        assert torch.get_num_threads() == 2


def test_a_gpu_step_leaves_the_host_threads_alone(two_threads) -> None:
    threads = LMThreads(torch.device("cuda"), macs_per_token=1, min_parallel_macs=10_000)
    assert not threads.single_thread(1)
    with threads.step(1):
        assert torch.get_num_threads() == 2


def test_the_engine_decodes_on_one_thread_prefills_on_all_and_answers_alike(
    qwen2_vl_dir: Path, two_threads
) -> None:
    prompt = {
        "prompt": "<|vision_start|><|image_pad|><|vision_end|>What is in the image?",
        "multi_modal_data": {"image": random_image(56, 56, seed=3)},
    }
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    answers = {}
    for name, min_macs in (("never one thread", 0), ("decodes on one", None)):
        llm = LLM(model=str(qwen2_vl_dir), device="cpu", cpu_threads=2)
        runner = llm.engine.core.executor.runner
        macs = runner.lm_threads.macs_per_token
        # the tiny checkpoint: one thread below 2 tokens' work, i.e. for its decodes alone
        runner.lm_threads = LMThreads(CPU, macs, 2 * macs if min_macs is None else min_macs)
        seen: list[int] = []
        runner.model.model.register_forward_hook(
            lambda *_, seen=seen: seen.append(torch.get_num_threads())
        )
        answers[name] = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert torch.get_num_threads() == 2
        if min_macs is None:
            assert seen == [2] + [1] * 5  # the prefill, then five decode steps
        else:
            assert seen == [2] * 6
    assert answers["decodes on one"] == answers["never one thread"]
