"""The engine with the Triton attention backend and the fused Triton layer ops (interpreted on the
CPU) answers exactly as with the torch backend and ops: greedy tokens, in one batch that mixes
image prefills, chunks and decodes."""

from __future__ import annotations

import msgspec
import pytest

from mmserve import LLM, SamplingParams
from mmserve.config.engine import EngineConfig
from tests.support.config_args import args_of
from tests.support.factory import random_image, write_tiny_checkpoint
from tests.support.parity_cases import DIVERSE

triton = pytest.importorskip("triton")

NUM_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
REQUESTS = [
    {
        "prompt": f"{IMG}What is in the image?",
        "multi_modal_data": {"image": random_image(56, 84, 1)},
    },
    "Describe a red circle.",
    {
        "prompt": f"{IMG} and {IMG}: same?",
        "multi_modal_data": {"image": [random_image(84, 56, 2), random_image(56, 56, 3)]},
    },
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("triton_e2e"), "qwen2_5_vl", seed=5, **DIVERSE
    )


def _greedy(model: str, **engine_args) -> tuple[list[list[int]], tuple[str, str]]:
    # 32-token steps cut the image prompts into chunks that start mid-block and mix with decodes
    with LLM(model=model, max_num_batched_tokens=32, **engine_args) as llm:
        outs = llm.generate(REQUESTS, GREEDY)
        names = (llm.config.attention_backend, llm.config.layer_ops)
        return [list(o.outputs[0].token_ids) for o in outs], names


@pytest.mark.skipif(
    not triton.knobs.runtime.interpret, reason="needs TRITON_INTERPRET=1 (tests/conftest.py)"
)
def test_triton_backend_is_greedy_identical_to_the_torch_backend(checkpoint) -> None:
    want, want_name = _greedy(str(checkpoint), attention_backend="torch")
    got, got_name = _greedy(str(checkpoint), attention_backend="triton")
    assert (want_name, got_name) == (("torch", "torch"), ("triton", "triton"))
    assert all(len(t) == NUM_TOKENS for t in got)
    assert got == want


@pytest.mark.skipif(
    not triton.knobs.runtime.interpret, reason="needs TRITON_INTERPRET=1 (tests/conftest.py)"
)
def test_the_choice_crosses_to_the_engine_process(checkpoint) -> None:
    """The engine process resolves the backend itself (it inherits TRITON_INTERPRET)."""
    encoded = msgspec.json.encode(EngineConfig.from_kwargs(attention_backend="triton"))
    assert msgspec.json.decode(encoded, type=EngineConfig).device.attention_backend == "triton"
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(model=str(checkpoint), attention_backend="torch") as llm:
        want = llm.generate(REQUESTS[0], params)[0].outputs[0].token_ids
    with LLM(model=str(checkpoint), multiprocess=True, attention_backend="triton") as llm:
        assert (llm.config.attention_backend, llm.config.layer_ops) == ("triton", "triton")
        assert llm.config.cuda_graph_sizes == ()  # a tuple again; graphs are off on a CPU
        assert llm.generate(REQUESTS[0], params)[0].outputs[0].token_ids == want


def test_auto_is_torch_on_a_machine_without_cuda(qwen2_vl_dir) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("auto is triton where CUDA is")
    with LLM(model=str(qwen2_vl_dir)) as llm:
        assert llm.config.attention_backend == "torch"


def test_a_bad_attention_backend_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--attention-backend must be one of"):
        EngineConfig.from_kwargs(attention_backend="flash")


def test_the_flag_reaches_engine_args() -> None:
    assert args_of().attention_backend == "auto"
    assert args_of("--attention-backend", "triton").attention_backend == "triton"


def test_triton_on_the_cpu_without_the_interpreter_stops_start_up(
    qwen2_vl_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(
        ValueError, match="runs on CUDA devices; on cpu it needs TRITON_INTERPRET=1"
    ):
        LLM(model=str(qwen2_vl_dir), device="cpu", attention_backend="triton")
