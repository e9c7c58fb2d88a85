"""Qwen3-VL on the triton attention backend and fused layer ops (Triton's interpreter on the
CPU), and with decode graphs captured (the eager stand-in replays the captured callable):
greedy answers equal transformers'. DeepStack is prefill-only: the graphs, captured over
decode steps, never see it."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.execution.graphs.capture import eager_graph_factory
from tests.support.parity_cases import CASES, _request

triton = pytest.importorskip("triton")
needs_interpreter = pytest.mark.skipif(
    not triton.knobs.runtime.interpret, reason="needs TRITON_INTERPRET=1 (tests/conftest.py)"
)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
NAMES = ("text_only", "one_image")


@needs_interpreter
def test_triton_path_and_decode_graphs_match_transformers(qwen3_vl_dir, qwen3_oracle) -> None:
    requests = [_request(*CASES[name]) for name in NAMES]
    expected = [qwen3_oracle.greedy(*CASES[name], 6) for name in NAMES]
    engine_args = dict(
        attention_backend="triton", enable_prefix_caching=False, max_num_batched_tokens=64
    )
    with LLM(model=str(qwen3_vl_dir), **engine_args) as llm:
        eager = [list(o.outputs[0].token_ids) for o in llm.generate(requests, GREEDY)]
        runner = llm.engine.core.executor.runner
        runner.capture_decode_graphs((1, 2), eager_graph_factory)
        graphed = [list(o.outputs[0].token_ids) for o in llm.generate(requests, GREEDY)]
    assert eager == expected
    assert graphed == expected
