"""torch.compile (-O1..-O3): the flag, greedy parity with the eager engine, no recompiles past
start-up, the inductor cache on disk.

Tolerance: inductor may reorder float sums inside a fused kernel (a norm's mean, a matmul's
epilogue), so compiled logits differ from eager ones by float32 rounding (measured: under 1e-7
absolute on these models). Greedy tokens must be identical, and the sampled tokens' logprobs
agree within 1e-4 (rounding, not a different computation: a wrong kernel is off by far more).
Compiles take tens of seconds on two cores: one test here runs in the default run, the
Qwen2.5-VL and Qwen3-VL ones are marked slow.
"""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.execution.compile import compiled_graph_count
from tests.support.config_args import args_of
from tests.support.factory import random_image, write_tiny_checkpoint
from tests.support.parity_cases import DIVERSE

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = [
    "Describe a red circle.",
    {"prompt": f"{IMG}What is it?", "multi_modal_data": {"image": random_image(56, 84, 1)}},
    "Count to ten:",
    {
        "prompt": f"{IMG}and{IMG} the same?",
        "multi_modal_data": {"image": [random_image(112, 60, 2), random_image(70, 140, 3)]},
    },
    "Once upon a time there was a very long prompt " * 6,
]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
# small chunks: prefills of many sizes and mixed steps, decodes of 5, 4, ... 1 sequences
ENGINE_ARGS = dict(enable_prefix_caching=False, max_num_batched_tokens=64)


def test_the_flag_is_vllms_optimization_level() -> None:
    assert args_of().optimization_level is None
    o0, o3 = args_of("-O0"), args_of("-O", "3")
    assert o0.runs_eager and not o0.compiles_model
    assert o3.compiles_model and not o3.runs_eager
    assert args_of("--optimization-level", "1").compiles_model
    assert args_of("--enforce-eager", "-O2").runs_eager  # compiled, no CUDA graphs
    with pytest.raises(SystemExit):
        args_of("-O4")


def _run(llm: LLM, prompts: list) -> tuple[list[list[int]], list[list[float]]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [
        [step[t].logprob for step, t in zip(c.logprobs, c.token_ids, strict=True)]
        for c in (o.outputs[0] for o in outs)
    ]
    return tokens, logprobs


def _check_parity(checkpoint, tmp_path) -> None:
    with LLM(model=str(checkpoint), **ENGINE_ARGS) as llm:
        assert llm.config.compiled is False
        want_tokens, want_logprobs = _run(llm, PROMPTS)
    cache_dir = tmp_path / "inductor"
    graphs_before_start = compiled_graph_count()
    with LLM(
        model=str(checkpoint), optimization_level=3, compile_cache_dir=str(cache_dir), **ENGINE_ARGS
    ) as llm:
        assert llm.config.compiled is True
        graphs_after_start = compiled_graph_count()
        assert graphs_after_start > graphs_before_start  # the warm-up compiled
        got_tokens, got_logprobs = _run(llm, PROMPTS)
        # every batch size, chunk and image grid ran on the graphs compiled at start-up
        one_by_one = [_run(llm, [p])[0][0] for p in PROMPTS[:2]]
        assert compiled_graph_count() == graphs_after_start
    assert got_tokens == want_tokens
    assert one_by_one == want_tokens[:2]
    for got, want in zip(got_logprobs, want_logprobs, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    assert any(cache_dir.rglob("*")), "inductor wrote nothing to --compile-cache-dir"


def test_compiled_qwen2_vl_is_greedy_identical_and_never_recompiles(tmp_path) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", "qwen2_vl", seed=3, **DIVERSE)
    _check_parity(checkpoint, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_compiled_windowed_and_deepstack_models_are_greedy_identical(arch, tmp_path) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", arch, seed=4, **DIVERSE)
    _check_parity(checkpoint, tmp_path)


@pytest.mark.slow
def test_compiled_layers_compose_with_the_decode_graph_capture(tmp_path) -> None:
    """The capture/replay code of the decode CUDA graphs over compiled layers (the CPU stand-in
    of a graph re-runs the captured callable; the Triton backend in its interpreter)."""
    triton = pytest.importorskip("triton")
    if not triton.knobs.runtime.interpret:
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py)")
    from mmserve.execution.graphs.capture import EagerGraph

    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", "qwen2_vl", seed=5, **DIVERSE)
    args = dict(ENGINE_ARGS, attention_backend="triton")
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(model=str(checkpoint), **args) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[:3], greedy)]
    cache_dir = str(tmp_path / "inductor")
    with LLM(
        model=str(checkpoint), optimization_level=3, compile_cache_dir=cache_dir, **args
    ) as llm:
        llm.engine.core.executor.runner.capture_decode_graphs((1, 2, 4), EagerGraph)
        graphs = compiled_graph_count()
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[:3], greedy)]
        assert compiled_graph_count() == graphs
    assert got == want
