"""`--enable-encoder-cuda-graph`: off by default, parsed, crossing to the engine process, and
refused where no graph can run (the CPU) with a message that names the flag."""

from __future__ import annotations

import msgspec
import pytest

from mmserve import LLM
from mmserve.config.engine import EngineConfig
from tests.support.config_args import args_of


def test_off_by_default_and_set_by_the_flag() -> None:
    assert args_of().enable_encoder_cuda_graph is False
    assert args_of("--enable-encoder-cuda-graph").enable_encoder_cuda_graph is True
    encoded = msgspec.json.encode(EngineConfig.from_kwargs(enable_encoder_cuda_graph=True))
    decoded = msgspec.json.decode(encoded, type=EngineConfig)
    assert decoded.device.enable_encoder_cuda_graph is True


def test_refused_on_the_cpu_in_process_and_in_the_engine_process(qwen2_vl_dir) -> None:
    # the engine process resolves the flag itself: its refusal comes back as the start failure
    for multiprocess, error in ((False, ValueError), (True, RuntimeError)):
        with pytest.raises(error, match="--enable-encoder-cuda-graph needs a CUDA device"):
            LLM(
                model=str(qwen2_vl_dir),
                device="cpu",
                enable_encoder_cuda_graph=True,
                multiprocess=multiprocess,
            )


def test_enforce_eager_turns_it_off(qwen2_vl_dir) -> None:
    with LLM(
        model=str(qwen2_vl_dir), device="cpu", enable_encoder_cuda_graph=True, enforce_eager=True
    ) as llm:
        assert llm.config.encoder_cuda_graph is False
