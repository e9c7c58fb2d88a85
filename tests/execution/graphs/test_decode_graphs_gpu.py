"""Decode CUDA graphs on a GPU: captured at start-up, greedy-identical to --enforce-eager."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from tests.support.factory import write_tiny_checkpoint
from tests.support.parity_cases import DIVERSE

triton = pytest.importorskip("triton")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        bool(triton.knobs.runtime.interpret), reason="TRITON_INTERPRET=1 is set: not compiled"
    ),
]

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(n: int) -> list[str]:
    return [f"request {i}: tell me a story about the number {i}" for i in range(n)]


def _greedy(model: str, prompts: list[str], **engine_args) -> tuple[list[list[int]], tuple]:
    with LLM(model=model, device="cuda", max_num_seqs=8, **engine_args) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm.config.cuda_graph_sizes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("graphs"), "qwen2_vl", seed=3, **DIVERSE)
    return str(path)


def _toy() -> str:
    from mmserve.config.model import bundled_toy_model_dir

    return bundled_toy_model_dir()


# 4 requests decode at batch 4, a captured size: the graph runs the eager step's shapes, so
# bfloat16 results are the same bits (padding changes GEMM shapes, checked in float32 below).
@pytest.mark.parametrize("which", ["tiny", "toy"])
def test_graphs_are_greedy_identical_to_eager_in_bfloat16(which: str, checkpoint: str) -> None:
    model = checkpoint if which == "tiny" else _toy()
    want, eager_sizes = _greedy(model, _prompts(4), dtype="bfloat16", enforce_eager=True)
    got, sizes = _greedy(model, _prompts(4), dtype="bfloat16")
    assert eager_sizes == () and sizes == (1, 2, 4, 8)
    assert got == want


def test_a_padded_batch_is_greedy_identical_in_float32(checkpoint: str) -> None:
    want, _ = _greedy(checkpoint, _prompts(5), dtype="float32", enforce_eager=True)
    got, sizes = _greedy(checkpoint, _prompts(5), dtype="float32", cuda_graph_sizes=(8,))
    assert sizes == (1, 2, 4, 8)  # one value: the ladder up to it; 5 pads to 8
    assert got == want


def test_the_sizes_cross_to_the_engine_process(checkpoint: str) -> None:
    with LLM(
        model=checkpoint, device="cuda", multiprocess=True, max_num_seqs=4, cuda_graph_sizes=(1, 4)
    ) as llm:
        assert llm.config.cuda_graph_sizes == (1, 4)
        out = llm.generate(_prompts(3), GREEDY, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 12 for o in out)


def test_the_capture_logs_what_the_graphs_took_beside_the_reserve(checkpoint: str, caplog) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="mmserve.execution.graphs.decode"):
        _greedy(checkpoint, _prompts(2), dtype="bfloat16", multiprocess=False)
    (line,) = [r for r in caplog.records if "decode CUDA graphs took" in r.message]
    assert "of the 256 MiB CUDA graph reserve" in line.message
    assert line.levelno == logging.INFO  # a tiny model's graphs fit the reserve
